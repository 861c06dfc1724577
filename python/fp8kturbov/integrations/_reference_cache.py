"""A fake-quantised transformers cache: a ``DynamicCache`` whose K and V pass through the NumPy
reference's quantise-dequantise on the way in, attended by the model's own attention (eager,
SDPA). It is what the compressed cache computes, up to the decode's arithmetic (bf16 queries and
outputs, sparse V), so comparisons against it measure the integration, and against the plain
cache the format. It also serves an FP8 (E4M3 K and V, per-layer scales) baseline.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from ..planning import calibrate_k_scale
from ._model_layers import PerLayer, per_layer


class ReferenceQuantizedCache(DynamicCache):
    """``DynamicCache(config=...)`` with K stored as ``decode_k(encode_k(k))`` and V as
    ``decode_v(encode_v(v))`` (``v_bits`` 2, 3, 4, the ``v_encoder``, the ``v_rotation`` of
    FORMAT.md §6 and its inverse), or with ``v_bits=None`` V in E4M3 too (an FP8 cache).

    ``k_scale`` (and ``v_scale`` for FP8 V): a value, a list per layer, a function of the layer
    index, or None to calibrate from the layer's first keys (values) as ``max / 448 · margin``.
    The scales used are in ``k_scales`` / ``v_scales`` (layer index -> float).
    """

    def __init__(self, config: Any, *, v_bits: PerLayer = 3, k_scale: PerLayer = None,
                 v_scale: PerLayer = None, margin: float = 2.0, v_encoder: PerLayer = "matched_norm",
                 v_rotation: PerLayer = "none") -> None:
        super().__init__(config=config)
        self.options = dict(v_bits=v_bits, k_scale=k_scale, v_scale=v_scale,
                            v_encoder=v_encoder, v_rotation=v_rotation)
        self.margin = margin
        self.k_scales: dict[int, float] = {}
        self.v_scales: dict[int, float] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from .. import reference

        option = {name: per_layer(name, value, layer_idx) for name, value in self.options.items()}
        keys = _values(key_states)
        k_scale = self._scale(self.k_scales, layer_idx, option["k_scale"], keys)
        keys = reference.decode_k(reference.encode_k(keys, k_scale), k_scale)
        values = _values(value_states)
        if option["v_bits"] is None:
            v_scale = self._scale(self.v_scales, layer_idx, option["v_scale"], values)
            values = reference.decode_k(reference.encode_k(values, v_scale), v_scale)
        else:
            rotated = option["v_rotation"] == "hadamard"
            head_dim = values.shape[-1]
            if rotated:
                values = reference.rotate_f32(values, head_dim)
            values = reference.decode_v(*reference.encode_v(values, option["v_bits"],
                                                            option["v_encoder"]), option["v_bits"])
            if rotated:
                values = reference.unrotate(values, head_dim)
        return super().update(_like(keys, key_states), _like(values, value_states), layer_idx,
                              *args, **kwargs)

    def _scale(self, scales: dict[int, float], layer_idx: int, given: float | None,
               sample: np.ndarray) -> float:
        if layer_idx not in scales:
            scales[layer_idx] = (float(given) if given is not None
                                 else calibrate_k_scale(sample) * self.margin)
        return scales[layer_idx]


def _values(tensor: torch.Tensor) -> np.ndarray:
    """A tensor rounded to bf16 (what the cache's write reads), as float32 NumPy."""
    return tensor.detach().to(torch.bfloat16).float().cpu().numpy()


def _like(values: np.ndarray, tensor: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(tensor.device, tensor.dtype)

"""Hugging Face transformers on the compressed cache: a ``Cache`` and an attention function.

::

    import fp8kturbov.integrations.transformers as fkt   # registers attn_implementation="fp8kturbov"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                                 attn_implementation=fkt.ATTN_IMPLEMENTATION)
    cache = fkt.Fp8kturbovCache(model, v_bits=3)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

`Fp8kturbovCache` keeps each attention layer's K and V in pages of this library's format: FP8 K,
2/3/4-bit V (``v_bits``, per layer), the write's V encoder and rotation. The model's attention
(`fp8kturbov_attention`) writes the new tokens, then attends: one new token per sequence through
the paged decode, 2-16 through the multi-token decode (the write inside it), longer chunks
(prefill) through the paged prefill. CUDA tensors go through the kernels, CPU tensors through the
NumPy reference (bit-exact to them, slow: for tiny models and tests; its prefill attends over the
dequantised cache, `fp8kturbov.integrations._dense`).

K scale. ``k_scale`` (a float, a list per layer, a function of the layer index, or None) is each
layer's FP8 scale; None calibrates it from the real keys of the layer's first write (the prompt):
``max |k| / 448 · k_scale_margin``. Later keys beyond ``448 · k_scale`` saturate to it (E4M3
clips, it does not wrap): the margin (default 2, one binade) is headroom for them, and costs
only the precision of the smallest keys, E4M3 keeping its relative precision over its range.

Padding. Only real tokens (1 in the attention mask) take cache positions; padding is never
written or attended, so left-padded batches need nothing else. `get_seq_length` counts the
columns seen (padding included), as transformers expects.

Not supported (each raises, naming the layer): layer types other than full and sliding-window
attention, MLA, head dims outside the decode's, encoder-decoder and bidirectional models, a 4-D
attention mask, dropout (training). ``torch.compile`` and CUDA graphs of the model are not
supported: the library is called through ctypes, and the step's bookkeeping is on the host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .._lib import VEncoder
from ..planning import calibrate_k_scale
from ._model_layers import (DECODE_HEAD_DIMS, SERVED_LAYER_TYPES, LayerShape, PerLayer,
                            UnsupportedLayerError, attention_layers, per_layer, text_config)
from ._paged_batch import PagedBatch, Step
from ._pools import PoolSpec, pools_for, step_array
from ._reference_cache import ReferenceQuantizedCache

__all__ = ["ATTN_IMPLEMENTATION", "DECODE_HEAD_DIMS", "SERVED_LAYER_TYPES", "Fp8kturbovCache",
           "Fp8kturbovLayer", "ReferenceQuantizedCache", "UnsupportedLayerError",
           "attention_layers", "fp8kturbov_attention", "padding_mask", "register"]

#: The ``attn_implementation`` name this module registers.
ATTN_IMPLEMENTATION = "fp8kturbov"
#: The default headroom of calibrated K scales (see the module docstring).
DEFAULT_K_SCALE_MARGIN = 2.0
_V_ENCODERS = tuple(encoder.name.lower() for encoder in VEncoder)


class Fp8kturbovLayer(CacheLayerMixin):
    """One attention layer's compressed K/V: pools (`fp8kturbov.integrations._pools`) over the
    cache's shared `PagedBatch`. ``update`` keeps the new K/V until the layer's attention writes
    them (it knows which tokens are padding) and attends."""

    is_compileable = False
    is_croppable = True

    def __init__(self, shape: LayerShape, spec: PoolSpec, k_scale: float | None,
                 k_scale_margin: float) -> None:
        super().__init__()
        self.shape, self.spec = shape, spec
        self.given_k_scale, self.k_scale_margin = k_scale, k_scale_margin
        self.is_sliding = shape.sliding_window > 0
        self.pools: Any = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.columns = 0  # token columns seen, padding included
        self.steps = 0  # forwards attended

    @property
    def k_scale(self) -> float | None:
        """The layer's K scale: given, or calibrated at its first write (None before)."""
        return self.given_k_scale if self.pools is None else self.pools.k_scale

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending is not None:
            raise RuntimeError(f"layer {self.shape.layer_idx}: its attention did not read the "
                               "fp8kturbov cache; load the model with "
                               f"attn_implementation={ATTN_IMPLEMENTATION!r}")
        _, num_kv_heads, _, head_dim = key_states.shape
        if (num_kv_heads, head_dim) != (self.shape.num_kv_heads, self.shape.head_dim):
            raise ValueError(f"layer {self.shape.layer_idx}: K/V of {num_kv_heads} heads of "
                             f"{head_dim}, the config gives {self.shape.num_kv_heads} of "
                             f"{self.shape.head_dim}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        self.columns += key_states.shape[-2]
        return key_states, value_states

    def attend(self, query: torch.Tensor, step: Step, *, scaling: float, sliding_window: int,
               soft_cap: float, sinks: torch.Tensor | None, num_pages: int) -> torch.Tensor:
        """Write the pending K/V at the step's slots, then attend; ``[B, T, Hq, D]``."""
        key, value = self.pending
        self.pending = None
        batch, num_q_heads, q_len, head_dim = query.shape
        rows = batch * q_len
        keys = key.transpose(1, 2).reshape(rows, self.shape.num_kv_heads, head_dim)
        values = value.transpose(1, 2).reshape(rows, self.shape.num_kv_heads, head_dim)
        queries = query.transpose(1, 2).reshape(rows, num_q_heads, head_dim)
        every_row = len(step.query_rows) == rows
        real_rows = None if every_row else step_array(step, query.device, "query_rows", torch.int64)
        if self.pools is None:
            self.pools = pools_for(query.device, self.spec, self._k_scale_for(keys, real_rows))
        self.pools.ensure_pages(num_pages)
        options = dict(scaling=scaling, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
        if len(step.query_rows) and step.fits_multi_token_decode:  # the write inside the decode
            q_rows, k_rows, v_rows = ((rows_of if every_row else rows_of[real_rows]) for rows_of in (queries, keys, values))
            out_rows = self.pools.decode(q_rows, step, appended=(k_rows, v_rows), **options)
        else:
            self.pools.write(keys, values, step)
            if len(step.query_rows) == 0:  # padding only: nothing to attend
                return torch.zeros_like(query).transpose(1, 2)
            out_rows = self.pools.prefill(queries if every_row else queries[real_rows], step, **options)
        out_rows = out_rows.to(query.dtype)
        if every_row:
            return out_rows.view(batch, q_len, num_q_heads, head_dim)
        out = torch.zeros((rows, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
        out[real_rows] = out_rows
        return out.view(batch, q_len, num_q_heads, head_dim)

    def _k_scale_for(self, keys: torch.Tensor, real_rows: torch.Tensor | None) -> float:
        if self.given_k_scale is not None:
            return self.given_k_scale
        real = keys if real_rows is None else keys[real_rows]
        # the largest key as the write reads it (rounded to bf16)
        amax = real.abs().amax().to(torch.bfloat16).float().item() if real.numel() else 0.0
        return calibrate_k_scale(np.array([amax])) * self.k_scale_margin

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # transformers < 5 asks for it by this name

    def crop(self, tokens_to_remove: int) -> None:
        """Done by `Fp8kturbovCache.crop` for all layers at once (the pages are shared)."""
        raise RuntimeError("crop the Fp8kturbovCache, not one of its layers")

    def reset(self) -> None:
        self.pools, self.pending, self.columns, self.steps = None, None, 0, 0

    @property
    def nbytes(self) -> int:
        return 0 if self.pools is None else self.pools.nbytes


def _check_spec(layer_idx: int, spec: PoolSpec) -> None:
    """The options of one layer, refused by name before anything is allocated."""
    where = f"layer {layer_idx}"
    if spec.v_bits not in (2, 3, 4):
        raise ValueError(f"v_bits of {where}: {spec.v_bits!r}, expected 2, 3 or 4")
    if spec.v_encoder not in _V_ENCODERS:
        raise ValueError(f"v_encoder of {where}: {spec.v_encoder!r}, expected one of {_V_ENCODERS}")
    if not isinstance(spec.block_size, int) or spec.block_size < 1:
        raise ValueError(f"block_size: {spec.block_size!r}, expected a positive integer")


_ACTIVE = threading.local()  # the cache whose update ran last in this thread


class Fp8kturbovCache(Cache):
    """A transformers ``Cache`` of this library's compressed pages, one `Fp8kturbovLayer` per
    decoder layer.

    ``model``: a model loaded with ``attn_implementation="fp8kturbov"``, or its config.
    ``v_bits`` (2, 3, 4), ``k_scale`` (None: calibrated, see the module docstring),
    ``v_encoder`` ("matched_norm", "mse", "projection") and ``v_rotation`` ("none", "hadamard"): a value, a list
    per layer, or a function of the layer index. ``block_size``: tokens per page.
    ``max_cache_len``: the pages of that many tokens per sequence are allocated at the first
    forward (else pages are added as the sequences grow, the pools doubling).
    ``sparse_v_threshold``: the decode's (None: the library's default; 0: exact).
    """

    def __init__(self, model: Any, *, v_bits: PerLayer = 3, k_scale: PerLayer = None,
                 k_scale_margin: float = DEFAULT_K_SCALE_MARGIN,
                 v_encoder: PerLayer = "matched_norm", v_rotation: PerLayer = "none",
                 block_size: int = 16, max_cache_len: int | None = None,
                 sparse_v_threshold: float | None = None) -> None:
        config = getattr(model, "config", model)
        implementation = getattr(config, "_attn_implementation", None)
        if hasattr(model, "config") and implementation != ATTN_IMPLEMENTATION:
            raise ValueError(f"the model's attn_implementation is {implementation!r}: load it with "
                             f"attn_implementation={ATTN_IMPLEMENTATION!r} (this module registers it)")
        if not k_scale_margin >= 1:
            raise ValueError(f"k_scale_margin = {k_scale_margin!r}, expected a number >= 1")
        layers, shapes = [], {}
        for i in range(text_config(config).num_hidden_layers):
            rotation = per_layer("v_rotation", v_rotation, i)
            if rotation not in ("none", "hadamard"):
                raise ValueError(f"v_rotation of layer {i}: {rotation!r}, expected 'none' or 'hadamard'")
            if rotation not in shapes:  # a rotation restricts the head dims
                shapes[rotation] = attention_layers(config, rotation)
            shape = shapes[rotation][i]
            spec = PoolSpec(shape.num_kv_heads, shape.head_dim, per_layer("v_bits", v_bits, i),
                            block_size, per_layer("v_encoder", v_encoder, i), rotation,
                            sparse_v_threshold)
            _check_spec(i, spec)
            layers.append(Fp8kturbovLayer(shape, spec, per_layer("k_scale", k_scale, i),
                                          k_scale_margin))
        super().__init__(layers=layers)
        self.block_size, self.reserved_len = block_size, max_cache_len
        self.paged: PagedBatch | None = None
        self.step: Step | None = None
        self.steps = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.paged is None:
            self.paged = PagedBatch(key_states.shape[0], self.block_size)
            if self.reserved_len:
                self.paged.reserve(self.reserved_len)
        _ACTIVE.cache = self
        return self.layers[layer_idx].update(key_states, value_states)

    def attend(self, layer_idx: int, query: torch.Tensor, padding: torch.Tensor | None,
               **options: Any) -> torch.Tensor:
        """Layer ``layer_idx``'s attention of this forward (`fp8kturbov_attention`)."""
        layer = self.layers[layer_idx]
        if layer.pending is None:
            raise RuntimeError(f"layer {layer_idx}: attention before the cache's update")
        if layer.steps == self.steps:  # the forward's first layer plans the step for all
            batch, _, q_len, _ = query.shape
            real = (np.ones((batch, q_len), dtype=bool) if padding is None
                    else padding.detach().cpu().numpy().astype(bool))
            self.step = self.paged.plan(real)
            self.steps += 1
        elif layer.steps != self.steps - 1:
            raise RuntimeError(f"layer {layer_idx} is {self.steps - layer.steps} forwards behind")
        layer.steps += 1
        return layer.attend(query, self.step, num_pages=self.paged.num_pages, **options)

    @property
    def nbytes(self) -> int:
        """Bytes of all layers' pools."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def batch_size(self) -> int:
        return -1 if self.paged is None else self.paged.batch_size

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` columns (0: none; a positive value, the older
        convention: keep that many), which must be real tokens of every sequence (assisted
        generation's rejected candidates are)."""
        tokens_to_remove = int(tokens_to_remove)  # assisted generation passes a tensor
        if tokens_to_remove > 0:
            tokens_to_remove = min(0, tokens_to_remove - self.get_seq_length())
        if tokens_to_remove == 0 or self.paged is None:
            return
        self.paged.crop(-tokens_to_remove)
        for layer in self.layers:
            layer.columns += tokens_to_remove

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx.detach().cpu().numpy())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.paged is not None:
            self._select(np.repeat(np.arange(self.paged.batch_size), repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(np.asarray(indices.detach().cpu() if torch.is_tensor(indices) else indices))

    def _select(self, rows: np.ndarray) -> None:
        if self.paged is None:
            return
        source, destination = self.paged.select(rows)
        for layer in self.layers:
            if layer.pools is not None:
                layer.pools.ensure_pages(self.paged.num_pages)
                layer.pools.copy_pages(source, destination)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.paged, self.step, self.steps = None, None, 0


def fp8kturbov_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None,
                         sliding_window: int | None = None, softcap: float | None = None,
                         s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function of ``attn_implementation="fp8kturbov"``: the module's new K/V went
    to the `Fp8kturbovCache` (its ``update``); this writes them and attends over the cache.
    ``attention_mask``: `padding_mask`'s (None or bool ``[B, T]``). Returns ``([B, T, Hq, D], None)``."""
    layer_idx = getattr(module, "layer_idx", None)
    where = f"layer {layer_idx} ({type(module).__name__})"
    cache = getattr(_ACTIVE, "cache", None)
    if cache is None or layer_idx is None or cache.layers[layer_idx].pending is None:
        raise RuntimeError(f"{where}: attn_implementation={ATTN_IMPLEMENTATION!r} attends over an "
                           "Fp8kturbovCache: pass past_key_values=Fp8kturbovCache(model) (and "
                           "use_cache=True)")
    if dropout:
        raise ValueError(f"{where}: attention dropout {dropout} (training) is not served")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise UnsupportedLayerError(f"{where}: non-causal attention is no decode of the library")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"{where}: a {attention_mask.dim()}-D attention mask; the fp8kturbov "
                         "attention takes the 2-D padding mask only")
    out = cache.attend(layer_idx, query, attention_mask,
                       scaling=query.shape[-1] ** -0.5 if scaling is None else float(scaling),
                       sliding_window=int(sliding_window or 0), soft_cap=float(softcap or 0.0),
                       sinks=s_aux)
    return out, None


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                 kv_offset: int = 0, mask_function: Callable | None = None,
                 attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """The mask function of ``attn_implementation="fp8kturbov"``: which new tokens are real, bool
    ``[B, q_length]``, or None where all are (the cache knows the rest: causality, windows and
    the padding of earlier steps)."""
    if attention_mask is None:
        return None
    new = attention_mask[:, -q_length:].to(torch.bool)
    return None if bool(new.all()) else new


def register() -> None:
    """Register ``attn_implementation="fp8kturbov"`` with transformers (done on import)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, fp8kturbov_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # older transformers build no mask for unknown implementations
        return
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)


register()

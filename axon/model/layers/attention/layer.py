"""The attention layer, and the op that keeps attention out of compiled graphs.

A compiled graph (one per bucket shape) holds everything of a layer except attention itself:
the step's metadata (block tables, ragged lengths) is host-side and changes every step, so
tracing it would recompile every step. Attention is an opaque op to Dynamo and Inductor that
takes this step's q, k, v and the layer's index, and finds the layer (its KV cache, its spec)
and the step's metadata in the forward context:

- a backend with a ``fused_layer_op`` (``cpu_flash``) attends a decoder layer in one C++ op
  that reads the step set by its ``begin_step``: no Python per layer;
- every other layer goes through ``torch.ops.axon.attention``, which calls the backend's
  ``forward`` (decoder) or ``forward_encoder`` (encoder-only).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from axon.distributed.parallel_state import get_tp_group
from axon.forward_context import get_forward_context
from axon.model.layers.attention.backend import AttentionBackend, AttentionSpec, AttentionType
from axon.model.layers.attention.context_parallel import attend_context_parallel


class Attention(nn.Module):
    """Attention of one layer. A decoder layer writes this step's K/V to its paged cache, then
    attends; an encoder-only layer attends over the step's own K/V and keeps none.

    The runner binds the layer's index (its place in ``model.attention_layers()``) and, for a
    decoder, ``kv_cache`` (a (k_cache, v_cache) pair of [num_blocks, block_size, num_kv_heads,
    head_dim] tensors) before the first forward.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        attn_type: AttentionType = AttentionType.DECODER,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (
            f"{num_heads} heads are not a multiple of {num_kv_heads} KV heads"
        )
        # Sinks are the layer's own parameter (``attn.sinks``), so that loading the model fills them;
        # the spec points at them again once the model is loaded (bind_kv_cache).
        self.sinks = None if sinks is None else nn.Parameter(sinks, requires_grad=False)
        self.spec = AttentionSpec(
            num_heads, num_kv_heads, head_dim, head_dim**-0.5, attn_type, sliding_window, self.sinks
        )
        # Decode context parallelism: this decoder's KV is sharded across its rank's group
        # (context_parallel.py), so it attends through ``forward_partial``, never the fused op.
        self.context_parallel = get_tp_group().dcp_size > 1 and attn_type is AttentionType.DECODER
        backend.check_spec(self.spec, self.context_parallel)
        self.backend = backend
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # An FP8 cache's float32 [layers, 2] (k_scale, v_scale) of this layer's model, shared
        # by its layers; None: the cache holds K and V as they are.
        self.kv_scales: torch.Tensor | None = None
        self.layer_idx = -1  # the layer's place in the model; bound by the runner

    @property
    def is_decoder(self) -> bool:
        return self.spec.attn_type is AttentionType.DECODER

    def bind_kv_cache(
        self,
        layer_idx: int,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        assert (kv_cache is not None) == self.is_decoder, "decoder layers, and only they, have a KV cache"
        self.layer_idx, self.kv_cache, self.kv_scales = layer_idx, kv_cache, kv_scales
        if (
            self.sinks is not None
        ):  # materialised and loaded since __init__; float32, as every backend reads them
            self.spec = dataclasses.replace(self.spec, sinks=self.sinks.detach().float().contiguous())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [T, H, D]; k, v [T, KVH, D] -> [T, H, D]
        fused = self.backend.fused_layer_op
        if fused is not None and self.is_decoder and not self.context_parallel:
            return fused(q, k, v, self.layer_idx, self.spec.scale)
        if torch.compiler.is_compiling():
            return torch.ops.axon.attention(q, k, v, self.layer_idx)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.layer_idx >= 0, "attention layer not bound: the runner binds every layer's index"
        metadata = get_forward_context().attn_metadata
        common = self.backend.common(metadata)
        if common.num_actual_tokens == 0:  # a compile-time forward: padding rows only
            return torch.zeros_like(q)
        if not self.is_decoder:
            return self.backend.forward_encoder(q, k, v, metadata, self.spec)
        assert self.kv_cache is not None, "KV cache not bound to this attention layer"
        k_cache, v_cache = self.kv_cache
        metadata = self.backend.layer_view(metadata, self.spec)
        self.backend.write_kv(k, v, k_cache, v_cache, metadata)
        if self.context_parallel:
            return attend_context_parallel(
                q,
                lambda group_q: self.backend.forward_partial(group_q, k_cache, v_cache, metadata, self.spec),
                get_tp_group(),
            )
        return self.backend.forward(q, k_cache, v_cache, metadata, self.spec)


@torch.library.custom_op("axon::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """Layer ``layer_idx`` of the forward context's model attends this step's q, k, v."""
    return get_forward_context().attention_layers[layer_idx].attend(q, k, v)


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return torch.empty_like(q)

"""The attention layer, and the ops that keep paged attention out of compiled graphs.

A compiled graph (one per bucket shape) holds everything of a decoder layer except paged
attention itself: the step's metadata (block tables, ragged lengths) is host-side and changes
every step, so tracing it would recompile every step. Attention is an opaque op to Dynamo and
Inductor that takes only this step's q, k, v (and constants) and finds its layer's KV cache and
the step's metadata where the runner put them:

- a backend with a ``layer_op`` (``cpu_flash``) is a C++ op that reads a step set in C++ by
  the backend's ``begin_step`` (called by ``set_forward_context``): no Python per layer;
- any other backend runs behind ``torch.ops.axon.paged_attention``, a Python custom op that
  finds the layer and metadata in the forward context.
"""

from __future__ import annotations

import torch
from torch import nn

from axon.forward_context import get_forward_context
from axon.model.layers.attention.backend import AttentionBackend, write_kv


class Attention(nn.Module):
    """Paged attention of one layer: write this step's K/V to the cache, then attend.

    The runner binds ``kv_cache`` (a (k_cache, v_cache) pair of
    [num_blocks, block_size, num_kv_heads, head_dim] tensors) before the first forward.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (
            f"{num_heads} heads are not a multiple of {num_kv_heads} KV heads"
        )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.layer_idx = -1  # the layer's place in the model; set with its cache

    def bind_kv_cache(self, layer_idx: int, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.layer_idx, self.kv_cache = layer_idx, kv_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [T, H, D]; k, v [T, KVH, D] -> [T, H, D]
        layer_op = getattr(self.backend, "layer_op", None)
        if layer_op is not None:
            return layer_op(q, k, v, self.layer_idx, self.scale)
        if torch.compiler.is_compiling():
            return torch.ops.axon.paged_attention(q, k, v)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.kv_cache is not None, "KV cache not bound to this attention layer"
        metadata = get_forward_context().attn_metadata
        if metadata.num_actual_tokens == 0:  # a compile-time forward: padding rows only
            return torch.zeros_like(q)
        k_cache, v_cache = self.kv_cache
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return self.backend.forward(q, k_cache, v_cache, metadata, self.scale)


@torch.library.custom_op("axon::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The next attention layer of this forward (layers are called in order, once each)."""
    return get_forward_context().next_attention_layer().attend(q, k, v)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)

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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [T, H, D]; k, v [T, KVH, D] -> [T, H, D]
        assert self.kv_cache is not None, "KV cache not bound to this attention layer"
        metadata = get_forward_context().attn_metadata
        k_cache, v_cache = self.kv_cache
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return self.backend.forward(q, k_cache, v_cache, metadata, self.scale)

"""The pure-torch reference attention backend: the oracle for every fast kernel.

One request at a time: gather its keys and values from the paged cache through its block
table, then causal attention of its queries (the last q_len positions of seq_len) in float32.
"""

from __future__ import annotations

import torch

from axon.model.layers.attention.backend import AttentionMetadata


class ReferenceAttentionBackend:
    name = "reference"

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.zeros_like(q)
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        bs = metadata.block_size
        for i, seq_len in enumerate(metadata.seq_lens):
            start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            q_len = end - start
            if q_len == 0:
                continue
            num_blocks = -(-seq_len // bs)
            blocks = metadata.block_table[i, :num_blocks]
            k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[-1])[:seq_len]  # [S, KVH, D]
            v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[-1])[:seq_len]
            k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
            v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
            qi = q[start:end].float().transpose(0, 1)  # [H, q_len, D]
            scores = torch.matmul(qi, k.transpose(1, 2)) * scale  # [H, q_len, S]
            q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)  # [q_len, 1]
            causal = torch.arange(seq_len).unsqueeze(0) <= q_pos  # [q_len, S]
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)  # [q_len, H, D]
        return out

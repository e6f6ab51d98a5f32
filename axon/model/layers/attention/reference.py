"""The pure-torch reference attention backend: the oracle for every fast kernel.

Keys and values are gathered from the paged cache through each request's block table and
attended in float32. Requests with one query (decodes) are attended together, padded to the
longest context; requests with several queries (prefill segments, speculative verification) one
at a time, bottom-right causal over their cached prefix. Grouped-query attention is native to
SDPA. It is also the one backend with every layer feature: a sliding window is a band of the
mask, and attention sinks (a learned per-head logit in every softmax's denominator) make it
compute the softmax itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from axon.model.layers.attention.backend import AttentionBackend, AttentionSpec, CommonAttentionMetadata


class ReferenceAttentionBackend(AttentionBackend):
    name = "reference"
    supports_sliding_window = True
    supports_sinks = True
    supports_context_parallel = True

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: CommonAttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        out = torch.zeros_like(q)
        qsl = metadata.query_start_loc
        q_lens = [qsl[i + 1] - qsl[i] for i in range(len(metadata.seq_lens))]
        decodes = [i for i, n in enumerate(q_lens) if n == 1]
        if decodes:
            rows = torch.tensor([qsl[i] for i in decodes], device=q.device)
            out[rows] = _attend_decodes(q[rows], k_cache, v_cache, metadata, decodes, spec).to(q.dtype)
        for i, n in enumerate(q_lens):
            if n > 1:
                seq_len = metadata.seq_lens[i]
                k, v = _gather_kv(
                    k_cache, v_cache, metadata.block_table[i : i + 1], seq_len, metadata.block_size
                )
                q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
                mask = _band(torch.arange(seq_len, device=q.device)[None, :], q_pos[:, None], spec)  # [n, S]
                out[qsl[i] : qsl[i + 1]] = _attend(q[None, qsl[i] : qsl[i + 1]], k, v, mask[None], spec)[
                    0
                ].to(q.dtype)
        return out

    def forward_partial(
        self,
        q: torch.Tensor,  # [num_tokens, heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: CommonAttentionMetadata,
        spec: AttentionSpec,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request on its own, over this rank's keys: key j is position j * world + rank."""
        world, rank = metadata.dcp_world, metadata.dcp_rank
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], NO_SCORE, dtype=torch.float32, device=q.device)
        qsl = metadata.query_start_loc
        for i, seq_len in enumerate(metadata.seq_lens):
            rows = slice(qsl[i], qsl[i + 1])
            num_keys = max(0, -(-(seq_len - rank) // world))  # positions rank, rank + world, ... < seq_len
            if num_keys == 0:
                continue
            k, v = _gather_kv(
                k_cache, v_cache, metadata.block_table[i : i + 1], num_keys, metadata.block_size
            )
            group = q.shape[1] // k.shape[2]
            kf = k[0].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
            vf = v[0].float().repeat_interleave(group, dim=1).transpose(0, 1)
            qf = q[rows].float().transpose(0, 1)  # [H, n, D]
            key_pos = torch.arange(num_keys, device=q.device) * world + rank
            q_pos = torch.arange(seq_len - (qsl[i + 1] - qsl[i]), seq_len, device=q.device)
            scores = (qf @ kf.transpose(-1, -2)) * spec.scale  # [H, n, S]
            scores = scores.masked_fill(~(key_pos[None, :] <= q_pos[:, None]), float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)  # [H, n]; -inf for a row without keys
            probs = torch.exp(scores - row_lse.clamp(min=NO_SCORE)[..., None])
            out[rows] = (probs @ vf).transpose(0, 1).to(q.dtype)
            lse[rows] = row_lse.clamp(min=NO_SCORE).transpose(0, 1)
        return out, lse


# The log-sum-exp of a row without keys (forward_partial): finite, as the C++ kernels' is.
NO_SCORE = -1e30


def _attend_decodes(
    q: torch.Tensor,  # [B, H, D], one query per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: CommonAttentionMetadata,
    req_idx: list[int],
    spec: AttentionSpec,
) -> torch.Tensor:  # [B, H, D]
    seq_lens = torch.tensor([metadata.seq_lens[i] for i in req_idx], device=q.device)
    max_len = int(seq_lens.max())
    block_table = metadata.block_table[torch.tensor(req_idx, device=q.device)]
    k, v = _gather_kv(k_cache, v_cache, block_table, max_len, metadata.block_size)
    mask = _band(torch.arange(max_len, device=q.device)[None, :], seq_lens[:, None] - 1, spec)  # [B, S]
    return _attend(q[:, None], k, v, mask[:, None], spec)[:, 0]


def _band(key_pos: torch.Tensor, query_pos: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """True where a query may read a key: causal, and within the sliding window if any."""
    mask = key_pos <= query_pos
    if spec.sliding_window is not None:
        mask &= key_pos > query_pos - spec.sliding_window
    return mask


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, seq_len, KVH, D] keys and values of the first seq_len positions of each table row."""
    num_blocks = -(-seq_len // block_size)
    table = block_table[:, :num_blocks]  # [B, nb]
    b = table.shape[0]
    k = k_cache[table].reshape(b, num_blocks * block_size, *k_cache.shape[2:])[:, :seq_len]
    v = v_cache[table].reshape(b, num_blocks * block_size, *v_cache.shape[2:])[:, :seq_len]
    return k, v


def _attend(
    q: torch.Tensor,  # [B, Q, H, D]
    k: torch.Tensor,  # [B, S, KVH, D]
    v: torch.Tensor,  # [B, S, KVH, D]
    mask: torch.Tensor,  # [B, Q, S] bool, True = may attend
    spec: AttentionSpec,
) -> torch.Tensor:  # [B, Q, H, D]
    if spec.sinks is None:
        # torch's SDPA accumulates in float32 for reduced-precision inputs; GQA is native.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=spec.scale,
            enable_gqa=True,
        )  # [B, H, Q, D]
        return out.transpose(1, 2)
    group = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)  # [B, H, Q, D]
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, S, D]
    vf = v.float().repeat_interleave(group, dim=2).transpose(1, 2)
    scores = (qf @ kf.transpose(-1, -2)) * spec.scale  # [B, H, Q, S]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    sink = spec.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)  # [B, H, Q, 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ vf).transpose(1, 2)  # [B, Q, H, D]

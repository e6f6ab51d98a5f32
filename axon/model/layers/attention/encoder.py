"""Encoder-only attention (BERT): bidirectional within each sequence, no KV cache.

The step's tokens are the usual flat layout (``backend.py``): sequences concatenated, split at
``query_start_loc``. An encoder prompt is never split across steps (the scheduler admits it
whole), so every sequence's keys are all in this step: nothing is written to or read from a
cache, and each token attends to every token of its own sequence and to no other.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def encoder_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """q [T, heads, head_dim], k, v [T, kv_heads, head_dim] -> [T, heads, head_dim]."""
    t, h, d = q.shape
    lens = torch.tensor([b - a for a, b in itertools.pairwise(query_start_loc)])
    if len(lens) == 1:  # one sequence: no padding, no mask
        out = F.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None] for x in (q, k, v)), scale=scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)
    b, longest = len(lens), int(lens.max())
    starts = torch.tensor(list(query_start_loc[:-1]))
    rows = torch.repeat_interleave(torch.arange(b), lens)  # [T] the sequence of each token
    flat = (rows * longest + torch.arange(t) - starts[rows]).to(q.device)  # [T] its padded slot

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D], zeros past each end
        out = x.new_zeros((b * longest, *x.shape[1:]))
        out[flat] = x
        return out.view(b, longest, *x.shape[1:]).transpose(1, 2)

    mask = (torch.arange(longest)[None, :] < lens[:, None]).to(q.device)[:, None, None, :]  # [B,1,1,L]
    out = F.scaled_dot_product_attention(
        padded(q), padded(k), padded(v), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(b * longest, h, d)[flat]

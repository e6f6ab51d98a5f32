"""The attention-backend interface and the per-step metadata every backend reads.

Layout of one step's flattened batch (requests concatenated, no padding between them):

    tokens:          | req0 q0..q2 | req1 q0 | req2 q0..q4 |   num_actual_tokens = 9
    query_start_loc:  0             3         4             9
    seq_lens:         context + new tokens of each request (what attention reads)
    slot_mapping[t] = block_id * block_size + offset where token t's K/V is written; -1 = padding,
                      written nowhere.

Invariant: a step's new K/V are written into the cache before any query of that step reads it,
so a request that hit blocks being filled by another request in the same step reads them whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padded rows
    query_start_loc: list[int]  # [num_reqs + 1], host side
    seq_lens: list[int]  # [num_reqs], host side
    block_table: torch.Tensor  # [num_reqs, max_num_blocks] int64, 0 (null block) past the end
    block_size: int
    _lengths: tuple[tuple, torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def length_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(query_start_loc, seq_lens) as int32 CPU tensors for kernels; built once per step
        (and again if the lists are changed)."""
        key = (tuple(self.query_start_loc), tuple(self.seq_lens))
        if self._lengths is None or self._lengths[0] != key:
            self._lengths = (
                key,
                torch.tensor(self.query_start_loc, dtype=torch.int32),
                torch.tensor(self.seq_lens, dtype=torch.int32),
            )
        return self._lengths[1], self._lengths[2]


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attend every query to its request's cached keys (new ones already written)."""
        ...


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = do not write
) -> None:
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    n = slot_mapping.shape[0]
    slots, k, v = slot_mapping, k[:n], v[:n]
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, v.to(flat_v.dtype))

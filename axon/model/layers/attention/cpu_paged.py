"""A fast pure-torch paged-attention backend for the CPU.

Same results as the reference backend (to rounding), several times faster, because it only
ever calls the kernels torch's CPU build makes fast:

- **Gather by ``index_select`` on the flattened cache**, and only the blocks the longest request
  of a group needs. Advanced indexing (``k_cache[table]``) on a bf16 cache runs a generic
  per-element kernel, measured 3x (large gathers) to 100x (small ones) slower than
  ``index_select``'s row copy.
- **Grouped-query heads as query rows.** A decode's ``[H, D]`` query is viewed as
  ``[KVH, G, D]``: the G query heads of one KV head become G query rows of that head, with no
  copy of K/V. The flash kernel then runs one ``[G, S]`` tile per (request, KV head) instead of
  G one-row tiles; with ``enable_gqa`` and one row per head (the reference) it measured ~8x
  slower. Prefill segments already have many rows per head and use ``enable_gqa``.
- **One SDPA call per group of requests with the same number of queries**: all decodes in one
  call, equal-length prefill segments batched in another. Shorter requests of a group are masked
  with a ``[b, 1, 1 or n, S]`` bool mask (the flash kernel takes it natively); no mask is built
  where none is needed (decodes that fill their blocks, prefills without a cached prefix, which
  use ``is_causal``: keys past a request's end lie above its causal diagonal, so they are
  excluded for free).
- **The plan is the step's metadata**: grouping, gather indices and masks depend only on the
  step, so ``build_metadata`` computes them once and every layer reuses them.
- **Gathers land in reused buffers** (``index_select(out=...)``), grow-only and shared by every
  layer and step: a fresh tensor per gather above glibc's mmap threshold (32 MiB at most) is
  mapped and page-faulted anew each time; for 64 decodes of ~640 tokens (4 KV heads of 64,
  float32) that made a gather 49 ms instead of 6.7 ms.

Layout of one group (``b`` requests with ``n`` queries each, ``S = num_blocks * block_size``):

    q rows   [b * n, H, D]        -> decode: [b, KVH, G, D]; prefill: [b, H, n, D]
    k, v     [b * num_blocks, block_size, KVH, D] (index_select) -> [b, S, KVH, D]
    mask     [b, 1, n, S] bool, True = may attend; key j of request r with seq_len L_r may be
             read by query i iff j <= L_r - n + i (bottom-right causal, covers a cached prefix)

Rows of ``q`` past ``metadata.num_actual_tokens`` (padding to a static size) come out as zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from axon.model.layers.attention.backend import AttentionBackend, AttentionSpec, CommonAttentionMetadata


@dataclass
class _Group:
    """Requests with the same query count, attended by one SDPA call."""

    q_len: int
    num_reqs: int
    rows: slice | torch.Tensor  # which rows of q (and of the output) the group owns
    block_ids: torch.Tensor  # [num_reqs * num_blocks] int64, into the cache's block dim
    num_blocks: int
    mask: torch.Tensor | None  # [num_reqs, 1, q_len, S] bool, None = no masking needed
    is_causal: bool  # prefill without cached prefix: top-left causal == bottom-right causal
    # [num_reqs * num_blocks, block_size, KVH, D] views of the backend's scratch: the gathers
    k_out: torch.Tensor | None = None
    v_out: torch.Tensor | None = None


@dataclass
class CpuPagedMetadata:
    """The step, and its groups (one SDPA call each)."""

    common: CommonAttentionMetadata
    groups: list[_Group]
    gather_shape: tuple[int, ...] | None = None  # cache geometry the groups' gather buffers fit


class CpuPagedAttentionBackend(AttentionBackend):
    name = "cpu_paged"

    def __init__(self) -> None:
        self._scratch: list[torch.Tensor] = []  # flat, grow-only; two per group

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuPagedMetadata:
        return CpuPagedMetadata(common, _build_groups(common))

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], num_tokens >= num_actual_tokens
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: CpuPagedMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        groups = self._with_buffers(metadata, k_cache)
        if len(groups) == 1 and isinstance(groups[0].rows, slice) and groups[0].rows == slice(0, len(q)):
            return _attend(q, k_cache, v_cache, groups[0], spec.scale)  # no padding rows: no copy
        out = torch.zeros_like(q)
        for group in groups:
            out[group.rows] = _attend(q[group.rows], k_cache, v_cache, group, spec.scale)
        return out

    def _with_buffers(self, metadata: CpuPagedMetadata, cache: torch.Tensor) -> list[_Group]:
        """The groups, their gathers landing in this backend's scratch (set on the first layer)."""
        shape = (cache.dtype, *cache.shape[1:])
        if metadata.gather_shape != shape:
            for i, group in enumerate(metadata.groups):
                size = (group.num_reqs * group.num_blocks, *cache.shape[1:])
                group.k_out = self._scratch_view(2 * i, size, cache)
                group.v_out = self._scratch_view(2 * i + 1, size, cache)
            metadata.gather_shape = shape
        return metadata.groups

    def _scratch_view(self, slot: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        while len(self._scratch) <= slot:
            self._scratch.append(like.new_empty(0))
        buf = self._scratch[slot]
        if buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._scratch[slot] = like.new_empty(numel)
        return buf[:numel].view(shape)


def _build_groups(metadata: CommonAttentionMetadata) -> list[_Group]:
    """Group the step's requests by query count, in order of first appearance."""
    qsl = metadata.query_start_loc
    num_reqs = len(metadata.seq_lens)
    assert len(qsl) == num_reqs + 1, f"query_start_loc has {len(qsl)} entries for {num_reqs} requests"
    assert qsl[-1] <= metadata.num_actual_tokens, (
        f"query_start_loc ends at {qsl[-1]} past num_actual_tokens={metadata.num_actual_tokens}"
    )
    by_q_len: dict[int, list[int]] = {}
    for i in range(num_reqs):
        n = qsl[i + 1] - qsl[i]
        if n > 0:
            by_q_len.setdefault(n, []).append(i)
    return [_build_group(metadata, n, req_idx) for n, req_idx in by_q_len.items()]


def _build_group(metadata: CommonAttentionMetadata, q_len: int, req_idx: list[int]) -> _Group:
    qsl, bs = metadata.query_start_loc, metadata.block_size
    seq_lens = [metadata.seq_lens[i] for i in req_idx]
    assert min(seq_lens) >= q_len, f"a request reads fewer keys than its {q_len} queries"
    num_blocks = -(-max(seq_lens) // bs)
    assert num_blocks <= metadata.block_table.shape[1], (
        f"seq_len {max(seq_lens)} needs {num_blocks} blocks; block_table has {metadata.block_table.shape[1]}"
    )
    device = metadata.block_table.device
    first, last = req_idx[0], req_idx[-1]
    contiguous = last - first + 1 == len(req_idx)
    if contiguous:
        rows: slice | torch.Tensor = slice(qsl[first], qsl[last + 1])
        table = metadata.block_table[first : last + 1, :num_blocks]
    else:
        rows = torch.tensor([qsl[i] + j for i in req_idx for j in range(q_len)], device=device)
        table = metadata.block_table[torch.tensor(req_idx, device=device), :num_blocks]
    block_ids = table.reshape(-1)

    seq_len_max = num_blocks * bs
    is_causal = q_len > 1 and all(s == q_len for s in seq_lens)
    if q_len == 1:
        needs_mask = any(s != seq_len_max for s in seq_lens)
    else:
        needs_mask = not is_causal
    mask = None
    if needs_mask:
        lens = torch.tensor(seq_lens, device=device)  # [b]
        key_pos = torch.arange(seq_len_max, device=device)  # [S]
        # Query i of a request with L keys sits at position L - q_len + i.
        last_key = lens[:, None] - q_len + torch.arange(q_len, device=device)[None, :]  # [b, n]
        mask = (key_pos[None, None, :] <= last_key[:, :, None])[:, None]  # [b, 1, n, S]
    return _Group(q_len, len(req_idx), rows, block_ids, num_blocks, mask, is_causal)


def _attend(
    q: torch.Tensor,  # [group rows, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _Group,
    scale: float,
) -> torch.Tensor:  # [group rows, H, D], q's dtype
    attend = _attend_decodes if group.q_len == 1 else _attend_prefills
    return attend(q, k_cache, v_cache, group, scale).to(q.dtype)


def _gather(cache: torch.Tensor, group: _Group, out: torch.Tensor | None) -> torch.Tensor:
    # [b, S, KVH, D]: the first num_blocks blocks of each request, in table order.
    if out is None:
        blocks = cache.index_select(0, group.block_ids)
    else:
        blocks = torch.index_select(cache, 0, group.block_ids, out=out)
    # blocks: [b * num_blocks, block_size, KVH, D]
    return blocks.view(group.num_reqs, group.num_blocks * cache.shape[1], *cache.shape[2:])


def _attend_decodes(
    q: torch.Tensor,  # [b, H, D], one query per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _Group,
    scale: float,
) -> torch.Tensor:  # [b, H, D]
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = _gather(k_cache, group, group.k_out).transpose(1, 2)  # [b, KVH, S, D]
    v = _gather(v_cache, group, group.v_out).transpose(1, 2)
    # The G query heads sharing a KV head are G query rows of that head: [b, KVH, G, D].
    qg = q.reshape(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=scale)  # [b, KVH, G, D]
    return out.reshape(b, num_heads, head_dim)


def _attend_prefills(
    q: torch.Tensor,  # [b * n, H, D], n queries per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _Group,
    scale: float,
) -> torch.Tensor:  # [b * n, H, D]
    num_heads, head_dim = q.shape[1:]
    b, n = group.num_reqs, group.q_len
    k = _gather(k_cache, group, group.k_out)  # [b, S, KVH, D]
    v = _gather(v_cache, group, group.v_out)
    # With several query rows per head, the flash kernel's native GQA is as fast as expanding
    # K/V (measured), and it keeps is_causal usable where folding G into query rows would not.
    out = F.scaled_dot_product_attention(
        q.reshape(b, n, num_heads, head_dim).transpose(1, 2),  # [b, H, n, D]
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=group.mask,
        is_causal=group.is_causal,
        scale=scale,
        enable_gqa=True,
    )  # [b, H, n, D]
    return out.transpose(1, 2).reshape(b * n, num_heads, head_dim)

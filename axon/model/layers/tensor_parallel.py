"""Splitting a decoder across tensor-parallel ranks (Megatron's layout, as vLLM's).

- Column-parallel (q/k/v, gate/up, the LM head): each rank holds a slice of the output rows;
  each part of a merged layer is sliced on its own (rank r holds q's r-th slice, k's and v's).
- Row-parallel (o_proj, down_proj): each rank holds a slice of the input columns; the partial
  outputs are summed by one all-reduce after attention and one after the MLP.
- Vocab-parallel embedding: each rank holds a slice of the rows; ids outside it give zeros, and
  the all-reduce assembles the embedding. The LM head's logits are gathered from every rank.
- KV heads are split like the query heads while there are at least as many as ranks; with more
  ranks than KV heads each rank holds the one KV head its query heads read (replicated).

A layer records where its rank's slice of each checkpoint tensor starts (``shard_slices``); the
loader reads only that slice (axon/model/models/weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from axon.distributed.parallel_state import get_tp_group, tp_all_gather, tp_all_reduce


@dataclass(frozen=True)
class ShardSlice:
    """Rank's slice of a checkpoint tensor: along ``dim``, from ``starts[i]`` for part i (one
    part unless the layer is merged)."""

    dim: int
    starts: tuple[int, ...]


def set_shard(module: nn.Module, param: str, dim: int, starts: tuple[int, ...]) -> None:
    """Record that ``module.<param>`` holds this rank's slice of the checkpoint's tensor."""
    if get_tp_group().size == 1:
        return
    slices = module.__dict__.setdefault("shard_slices", {})
    slices[param] = ShardSlice(dim, tuple(starts))


def split(total: int, what: str) -> tuple[int, int]:
    """This rank's (start, count) of ``total`` items split evenly; an uneven split is an error
    that names ``what``."""
    group = get_tp_group()
    count = check_share(total, group.size, what)
    return group.rank * count, count


def check_share(total: int, size: int, what: str) -> int:
    """``total / size``; an uneven split is an error that names ``what``."""
    if total % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {what} ({total})")
    return total // size


def kv_heads(num_kv_heads: int, num_heads: int) -> tuple[int, int]:
    """This rank's (first KV head, count): split like the query heads, or the one its query
    heads read when there are fewer KV heads than ranks."""
    group = get_tp_group()
    _check_kv_heads(num_kv_heads, group.size)
    if num_kv_heads >= group.size:
        return split(num_kv_heads, "number of KV heads")
    first_q, _ = split(num_heads, "number of attention heads")
    return first_q // (num_heads // num_kv_heads), 1


def _check_kv_heads(num_kv_heads: int, size: int) -> None:
    if num_kv_heads >= size:
        check_share(num_kv_heads, size, "number of KV heads")
    elif size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} is more than the model's {num_kv_heads} KV heads and not a multiple of them"
        )


def check_split(num_heads: int, num_kv_heads: int, intermediate_size: int | None, size: int) -> None:
    """Raise (naming the dimension) unless a decoder with these sizes splits across ``size``
    ranks; what start-up checks before any rank loads. ``intermediate_size`` None: no dense MLP."""
    check_share(num_heads, size, "number of attention heads")
    _check_kv_heads(num_kv_heads, size)
    if intermediate_size is not None:
        check_share(intermediate_size, size, "intermediate_size")


def padded_vocab_share(vocab_size: int) -> tuple[int, int]:
    """This rank's (first row, rows) of the vocabulary, every rank's share padded to one size."""
    group = get_tp_group()
    rows = -(-vocab_size // group.size)
    return group.rank * rows, rows


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` over this rank's rows of the vocabulary (all of it with one rank)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.first_row, rows = padded_vocab_share(vocab_size)
        super().__init__(rows, hidden_size)
        set_shard(self, "weight", 0, (self.first_row,))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_group().size == 1:
            return super().forward(input_ids)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return tp_all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's logits [N, rows] -> [N, vocab_size], in vocabulary order."""
    if get_tp_group().size == 1:
        return local
    stacked = tp_all_gather(local)  # [size, N, rows]
    return stacked.permute(1, 0, 2).reshape(local.shape[0], -1)[:, :vocab_size]

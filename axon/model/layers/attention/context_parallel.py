"""Decode context parallelism: a sequence's K/V sharded across the ranks of a group, by position.

The D ranks of a group (consecutive tensor-parallel ranks that hold the same KV heads, each with
its own query heads) each keep positions p with p mod D == its place in the group, so a long
sequence takes 1/D of each rank's cache (backend.py's layout). One layer's attention:

    q of the group's D ranks (all-gather)      [tokens, D x heads, head_dim]
    each rank: those queries over its own keys  -> partial outputs and log-sum-exps
    every rank's partials (all-gather)          -> for its own heads, the D partials merged:
                                                   out = sum_r exp(lse_r - max) out_r / sum_r exp(lse_r - max)

The merge is exact (the softmax over all keys, regrouped), taken in rank order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from axon.distributed.parallel_state import TensorParallelGroup, tp_all_gather
from axon.platforms.cpu_kernels import use_cpu_kernels


def attend_context_parallel(
    q: torch.Tensor,  # [tokens, heads, head_dim]: this rank's query heads
    attend_partial: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    group: TensorParallelGroup,
) -> torch.Tensor:  # [tokens, heads, head_dim]
    """This rank's heads attended over the whole group's keys. ``attend_partial`` attends
    [tokens, D x heads, head_dim] queries over this rank's keys: (out, float32 log-sum-exp)."""
    size, first, place = group.dcp_size, group.dcp_first, group.dcp_rank
    tokens, heads, head_dim = q.shape
    members = slice(first, first + size)
    group_q = tp_all_gather(q.contiguous())[members]  # [D, tokens, heads, head_dim]
    out, lse = attend_partial(group_q.transpose(0, 1).reshape(tokens, size * heads, head_dim))
    mine = slice(place * heads, (place + 1) * heads)  # this rank's heads among the group's
    outs = tp_all_gather(out)[members, :, mine]  # [D, tokens, heads, head_dim]
    lses = tp_all_gather(lse)[members, :, mine]  # [D, tokens, heads]
    return merge_partials(outs, lses)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Partial attentions over disjoint key sets ([parts, tokens, heads, head_dim] and their
    [parts, tokens, heads] float32 log-sum-exps) -> attention over their union, in outs' dtype,
    summed in float32 in part order. Parts without keys weigh 0 (their log-sum-exp is -1e30);
    rows with no key anywhere come out 0. One C++ op on the CPU (axon/csrc/cpu_attention.cpp),
    these torch ops elsewhere."""
    if use_cpu_kernels(outs):
        return torch.ops.axon_cpu.merge_attention_partials(outs, lses)
    weights = torch.softmax(lses, dim=0).unsqueeze(-1)  # [parts, tokens, heads, 1]
    return (weights * outs.float()).sum(dim=0).to(outs.dtype)

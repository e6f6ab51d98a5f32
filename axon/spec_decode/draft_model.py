"""The draft-model proposer: a smaller model with the target's tokenizer drafts k tokens greedily.

Its KV cache is its own tensors indexed by the target's block tables (the same block ids), so
the scheduler's allocation covers both; ``num_lookahead_tokens`` gives the blocks its drafts
write past the step. Per request it remembers how far its KV is valid (``num_computed``):

    known tokens:   x_0 ........................ x_{L-1}        (L after this step)
    draft KV valid: [0, num_computed)        catch-up pass: x_{num_computed} .. x_{L-1} -> d_1
    decode pass j:  d_j at position L - 1 + j -> d_{j+1}       (j = 1 .. k - 1)

so the draft catches up over whatever the target accepted since its last proposal (steps the
policy skipped included) in one pass, and its KV past L - 1 (written from drafts) is never
trusted. A request starts at its first computed position: prefix-cache hits share the draft's
KV of those blocks too (written by the request that computed them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from axon.forward_context import set_forward_context
from axon.model.layers.attention import Segment, describe_step
from axon.sample.sampler import argmax
from axon.spec_decode.proposer import DraftBatch, DraftRequest, Proposer


def run_segments(
    model: nn.Module,
    layers: Sequence[nn.Module],
    segments: list[Segment],
    token_ids: list[int],
    block_size: int,
    device: torch.device,
    **extra: torch.Tensor,
) -> torch.Tensor:
    """One forward of ``model`` over ``segments`` (tokens concatenated): its output [T, ...]."""
    positions = [p for seg in segments for p in range(seg.start, seg.end)]
    metadata = describe_step(segments, block_size, device)
    with set_forward_context(metadata, layers):
        return model(
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            **extra,
        )


def draft_greedily(
    first_drafts: list[int],
    first_slots: list[int],
    requests: Sequence[DraftRequest],
    num_drafts: int,
    block_size: int,
    decode: Callable[[list[int], list[Segment], list[int]], list[int]],
) -> list[list[int]]:
    """Up to ``num_drafts`` drafts per request: its first (from the catch-up pass), then one
    decode pass per further draft. ``decode(active, segments, tokens)`` feeds the last draft of
    each active request (indices into ``requests``) as a one-token segment, draft j at position
    ``first_slots[i] + j - 1``, and returns their next drafts. A request stops where its blocks
    end: the drafts' KV slots are the scheduler's lookahead slots, which it may cut short."""
    drafts = [[t] for t in first_drafts]
    active = list(range(len(requests)))
    for j in range(1, num_drafts):
        active = [i for i in active if first_slots[i] + j - 1 < len(requests[i].block_ids) * block_size]
        if not active:
            break
        segments = [
            Segment(requests[i].block_ids, first_slots[i] + j - 1, first_slots[i] + j) for i in active
        ]
        for i, t in zip(active, decode(active, segments, [drafts[i][-1] for i in active]), strict=True):
            drafts[i].append(t)
    return drafts


class DraftModelProposer(Proposer):
    def __init__(self, model: nn.Module, block_size: int, device: torch.device) -> None:
        self.model = model
        self.layers = model.attention_layers()
        self.block_size = block_size
        self.device = device
        self.num_computed: dict[str, int] = {}  # req_id -> positions whose draft KV is valid

    def kv_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def begin(self, req_id: str, first_position: int) -> None:
        self.num_computed[req_id] = first_position

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.num_computed.pop(req_id, None)

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        requests = [r for r in batch.requests if r.wants_drafts]
        drafts: dict[str, list[int]] = {r.req_id: [] for r in batch.requests}
        if batch.num_drafts == 0 or not requests:
            return [drafts[r.req_id] for r in batch.requests]
        segments, token_ids, last_rows = [], [], []
        for r in requests:
            length = len(r.token_ids)
            start = min(self.num_computed.get(r.req_id, r.first_position), length - 1)
            segments.append(Segment(r.block_ids, start, length))
            token_ids += r.token_ids[start:length]
            last_rows.append(len(token_ids) - 1)
            self.num_computed[r.req_id] = length
        hidden = run_segments(self.model, self.layers, segments, token_ids, self.block_size, self.device)

        def decode(active: list[int], segments: list[Segment], tokens: list[int]) -> list[int]:
            hidden = run_segments(self.model, self.layers, segments, tokens, self.block_size, self.device)
            return self._greedy(hidden)

        # Draft j is fed at position L - 1 + j: the draft's KV slots follow the known tokens.
        slots = [len(r.token_ids) for r in requests]
        found = draft_greedily(
            self._greedy(hidden[last_rows]), slots, requests, batch.num_drafts, self.block_size, decode
        )
        drafts.update((r.req_id, d) for r, d in zip(requests, found, strict=True))
        return [drafts[r.req_id] for r in batch.requests]

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        logits = self.model.compute_logits(hidden).to(torch.float32)  # [n, vocab]
        return argmax(logits.contiguous()).tolist()

"""The EAGLE3 proposer: a one-layer head drafts from the target's own hidden states.

The head reads, at target position p, the embedding of the token after it and the target's
hidden state there (``combine_hidden_states`` of three aux layers), and predicts the token
after that (vLLM's ``EagleProposer``, the EAGLE3 paper). Its KV at position p lives in the
target's block tables, like a draft model's:

    target rows:    h_p for every position the target computed (valid rows only)
    pending:        h_p of positions whose next token x_{p+1} is known, not yet fed to the head
    catch-up pass:  (x_{p+1}, h_p) for every pending p, in one pass -> d_1 from the last p = L - 2
    decode pass j:  (d_j, the head's output that predicted d_j) at position L - 2 + j -> d_{j+1}

where L is the number of known tokens after the step. The target's hidden states cannot be
computed again later, so every step's valid rows are combined at once and kept as pending until
a pass reads them: a pass runs in steps that draft (the policy may skip steps), or once
``MAX_PENDING_ROWS`` pile up, and catches up every request of the step, prefill segments
included (they draft nothing). The head's KV past L - 2 (written from drafts) is never trusted:
the next catch-up starts at L - 1.

A prefix-cache hit (``begin``) starts pending at the first computed position: the head's KV of
the cached positions is what the request that computed those blocks wrote, or nothing where that
request never fed them (it finished before a catch-up, or its next token differed after the
block's last position). Drafts are still verified, so this costs acceptance, never correctness,
as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from axon.model.layers.attention import Segment
from axon.sample.sampler import argmax
from axon.spec_decode.draft_model import draft_greedily, run_segments
from axon.spec_decode.eagle3 import Eagle3DraftModel
from axon.spec_decode.proposer import DraftBatch, DraftRequest, Proposer

# Pending rows of a step's requests past which a step that drafts nothing catches up anyway:
# while the policy drafts nothing (large batches) they would grow with every token generated.
MAX_PENDING_ROWS = 8192


@dataclass
class _Pending:
    """Target positions [start, start + rows) whose combined hidden states the head has not read."""

    start: int
    hidden: list[torch.Tensor] = field(default_factory=list)  # each [n, hidden], in position order

    @property
    def num_rows(self) -> int:
        return sum(h.shape[0] for h in self.hidden)

    @property
    def end(self) -> int:
        return self.start + self.num_rows


class Eagle3Proposer(Proposer):
    hidden_states = "aux"

    def __init__(
        self, head: Eagle3DraftModel, target: nn.Module, block_size: int, device: torch.device
    ) -> None:
        if not hasattr(target, "set_aux_hidden_state_layers"):
            raise ValueError(
                f"speculative_config.method 'eagle3' needs a target that hands over its aux hidden "
                f"states (the Llama family); {type(target).__name__} does not"
            )
        # Set before the first forward: a compiled graph traces the target with its aux outputs.
        target.set_aux_hidden_state_layers(head.aux_layer_ids)
        head.share_embeddings(target)
        self.head = head
        self.layers = head.attention_layers()
        self.block_size = block_size
        self.device = device
        self.pending: dict[str, _Pending] = {}

    def kv_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def begin(self, req_id: str, first_position: int) -> None:
        self.pending[req_id] = _Pending(first_position)

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.pending.pop(req_id, None)

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        self._keep_rows(batch)
        requests = [r for r in batch.requests if r.wants_drafts]
        drafts: dict[str, list[int]] = {r.req_id: [] for r in batch.requests}
        if batch.num_drafts == 0 or not requests:
            if sum(self.pending[r.req_id].num_rows for r in batch.requests) > MAX_PENDING_ROWS:
                self._catch_up(batch.requests, set())
            return [drafts[r.req_id] for r in batch.requests]
        last = self._catch_up(batch.requests, {r.req_id for r in requests})  # [len(requests), hidden]

        def decode(active: list[int], segments: list[Segment], tokens: list[int]) -> list[int]:
            out = run_segments(
                self.head, self.layers, segments, tokens, self.block_size, self.device, hidden=last[active]
            )
            last[active] = out
            return self._greedy(out)

        # Draft j is fed at position L - 2 + j: the head's slot p reads the token after p.
        slots = [len(r.token_ids) - 1 for r in requests]
        found = draft_greedily(self._greedy(last), slots, requests, batch.num_drafts, self.block_size, decode)
        drafts.update((r.req_id, d) for r, d in zip(requests, found, strict=True))
        return [drafts[r.req_id] for r in batch.requests]

    def _keep_rows(self, batch: DraftBatch) -> None:
        """Combine the valid rows of every request (one ``fc`` over the step) into its pending."""
        assert batch.hidden_states is not None, "EAGLE3 reads the target's aux hidden states"
        rows = [i for r in batch.requests for i in range(r.row, r.row + r.num_valid_rows)]
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.int64, device=batch.hidden_states.device)
        # A new tensor: a compiled graph reuses its output buffer in the next step.
        combined = self.head.combine_hidden_states(batch.hidden_states[index])  # [len(rows), hidden]
        parts = combined.split([r.num_valid_rows for r in batch.requests])
        for r, part in zip(batch.requests, parts, strict=True):
            pending = self.pending.setdefault(r.req_id, _Pending(r.first_position))
            assert pending.end == r.first_position, (
                f"{r.req_id}: the step's rows start at {r.first_position}, its pending ends at {pending.end}"
            )
            if part.shape[0]:
                pending.hidden.append(part)

    def _catch_up(self, requests: list[DraftRequest], drafting: set[str]) -> torch.Tensor:
        """Feed every pending (x_{p+1}, h_p) of ``requests`` in one pass; the output at the last
        pending position of each drafting request, in order [len(drafting), hidden]."""
        segments, token_ids, parts, last_rows = [], [], [], []
        for r in requests:
            pending = self.pending[r.req_id]
            if not pending.hidden:
                assert r.req_id not in drafting, f"{r.req_id}: drafting with no new target rows"
                continue
            start, end = pending.start, pending.end
            assert r.req_id not in drafting or end == len(r.token_ids) - 1, (
                f"{r.req_id}: pending ends at {end}, not at its last known token's position"
            )
            segments.append(Segment(r.block_ids, start, end))
            token_ids += r.token_ids[start + 1 : end + 1]
            parts += pending.hidden
            if r.req_id in drafting:
                last_rows.append(len(token_ids) - 1)
            self.pending[r.req_id] = _Pending(end)
        hidden = torch.cat(parts)  # [len(token_ids), hidden]
        out = run_segments(
            self.head, self.layers, segments, token_ids, self.block_size, self.device, hidden=hidden
        )
        return out[last_rows]

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        # [n, hidden] -> n target token ids
        draft_ids = argmax(self.head.compute_draft_logits(hidden).contiguous())
        return self.head.draft_to_target(draft_ids).tolist()

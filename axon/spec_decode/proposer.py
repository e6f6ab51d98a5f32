"""The proposer interface: after a step, draft the next tokens of every request that sampled.

A proposer sees each sampling request's known tokens (this step's accepted tokens appended)
and, for model-based proposers, the rows of the step it computed: their positions, block
tables and the target's hidden states. It returns up to ``num_drafts`` tokens per request,
greedily chosen (the rejection sampler relies on deterministic drafts). State a proposer keeps
per request (a draft model's KV progress) is dropped by ``forget``.

Registry: ``make_proposer(method, ...)``; methods ngram, draft_model, eagle3.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from axon.spec_decode.config import SpecDecodeConfig
from axon.spec_decode.ngram import ngram_propose


@dataclass
class DraftRequest:
    req_id: str
    token_ids: list[int]  # every known token, this step's included
    block_ids: list[int]
    # The rows this step computed for the request (``row`` onwards in the step's hidden
    # states) from position ``first_position``; ``num_valid_rows`` of them had accepted inputs.
    row: int
    first_position: int
    num_valid_rows: int
    wants_drafts: bool  # it sampled this step (else a prefill segment: only its rows count)


@dataclass
class DraftBatch:
    requests: list[DraftRequest]
    num_drafts: int
    hidden_states: torch.Tensor | None = None  # [T, H] the step's target rows (aux for EAGLE3)


class Proposer(ABC):
    # What the target must hand over: None, "final" hidden states, or "aux" (EAGLE3's layers).
    hidden_states: str | None = None

    @abstractmethod
    def propose(self, batch: DraftBatch) -> list[list[int]]:
        """Drafts per request of ``batch`` (at most ``batch.num_drafts`` each, maybe none; none
        for a request that does not want drafts). Called after every step, also when
        ``num_drafts`` is 0, so a proposer can keep up with the step's rows."""

    def begin(self, req_id: str, first_position: int) -> None:
        """A request arrives (or resumes) with KV up to ``first_position`` (its prefix-cache hit)."""

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the state kept for these requests (finished or preempted)."""

    def kv_layers(self) -> list[Any]:
        """The draft's paged attention layers: the worker gives each a KV cache of the target's
        block count (the same block ids), indexed from 0 in this list."""
        return []


class NgramProposer(Proposer):
    def __init__(self, config: SpecDecodeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        k = batch.num_drafts
        return [
            ngram_propose(r.token_ids, k, self.min_n, self.max_n) if k and r.wants_drafts else []
            for r in batch.requests
        ]

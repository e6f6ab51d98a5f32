"""The structured-output bitmask in the sampler: disallowed tokens get -inf.

The scheduler sends one packed int32 row per constrained request that samples this step
(``GrammarOutput``); ``GrammarBitmask.from_output`` lines those rows up with the sampler's rows.
Rows without a grammar (unconstrained requests, bucket padding) are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from axon.scheduler_output import GrammarOutput


@dataclass
class GrammarBitmask:
    rows: torch.Tensor  # [k] int64: sampler rows that are constrained
    bitmask: torch.Tensor  # [k, ceil(V / 32)] int32, packed: bit j of word w allows token 32 * w + j

    @staticmethod
    def from_output(
        grammar_output: GrammarOutput | None, row_req_ids: list[str], device: torch.device
    ) -> GrammarBitmask | None:
        """The rows of ``grammar_output`` for the requests sampled in rows ``row_req_ids``."""
        if grammar_output is None:
            return None
        row_of = {req_id: row for row, req_id in enumerate(row_req_ids)}
        pairs = [(row_of[r], i) for i, r in enumerate(grammar_output.req_ids) if r in row_of]
        assert len(pairs) == len(grammar_output.req_ids), (
            f"grammar rows for requests that do not sample this step: "
            f"{sorted(set(grammar_output.req_ids) - set(row_of))}"
        )
        if not pairs:
            return None
        packed = torch.from_numpy(grammar_output.bitmask)  # [n, W] int32
        sources = torch.tensor([i for _, i in pairs], dtype=torch.int64)
        return GrammarBitmask(
            rows=torch.tensor([row for row, _ in pairs], dtype=torch.int64, device=device),
            bitmask=packed.index_select(0, sources).to(device),
        )


_BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 [k, W] -> allowed bool [k, vocab_size]."""
    shifts = _BIT_POSITIONS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [k, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask) -> torch.Tensor:
    """Set disallowed tokens of the constrained rows of ``logits`` [B, V] to -inf, in place."""
    allowed = unpack_bitmask(grammar.bitmask, logits.shape[1])  # [k, V]
    constrained = logits.index_select(0, grammar.rows).masked_fill_(~allowed, float("-inf"))  # [k, V]
    return logits.index_copy_(0, grammar.rows, constrained)
